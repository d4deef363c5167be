"""The adapters of a LoRA run (``trainer.lora.enabled``) out of its checkpoints: the full
(unsharded, one-process) adapter state and its record, written at the end of the run to
``<run dir>/lora`` and by ``vitp-export RUN --format lora``.

The state is the tp = 1 model's ``state_dict()`` restricted to the ``*.lora_A`` / ``*.lora_B``
keys (vitp's canonical names, ``blocks.3.attn.qkv.lora_A``), fp32; a fused linear holds one
adapter per targeted piece (:mod:`vitp.parallel.lora`). The record (JSON next to it):
``{"rank", "alpha", "rslora", "dropout", "targets", "pieces": {linear: [piece indices]},
"base": {"folder", "hash"}}`` (:func:`vitp.models.lora.run_record`). The adapters are small, so one
process assembles them (the base is never read).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from vitp.models.lora_files import STATE  # "lora.safetensors"

LORA_DIR = "lora"  # <run dir>/lora: the final EMA adapters
RECORD = "lora.json"


def full_lora_state(tag_dir: Path, kind: str = "ema") -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(state, record)`` of a LoRA run's checkpoint folder ``tag_dir``: ``state`` ``{canonical
    key: fp32 tensor}`` of the ``kind`` (``ema`` or ``model``) adapters, full shapes (``lora_A``
    ``(n_t r, in)``, ``lora_B`` ``(n_t out_piece, r)``), read in one process without a process
    group; ``record`` as the module docstring.

    Raises ``ValueError`` naming the checkpoint when it is not a LoRA run's (no record, no adapter
    tensor), ``FileNotFoundError`` when its files are missing.
    """
    from vitp.checkpoint.export import CHECKPOINT_META
    from vitp.checkpoint.sharded import read_full, tensor_shapes
    from vitp.parallel.lora import is_lora_key

    tag_dir = Path(tag_dir)
    meta_file = tag_dir / CHECKPOINT_META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{tag_dir} has no {CHECKPOINT_META}: give a complete training checkpoint folder")
    record = json.loads(meta_file.read_text()).get("lora")
    keys = [k for k in tensor_shapes(tag_dir, kind) if is_lora_key(k)]
    if not record or not keys:
        raise ValueError(f"checkpoint {tag_dir} is not a LoRA run's (trainer.lora.enabled=false): it holds no adapters; "
                         "export its weights with vitp-export --format diffusers (Wan) or the vitp format")
    state = {k: v.float().contiguous() for k, v in read_full(tag_dir, kind, keys).items()}
    return state, record


def write_lora(tag_dir: Path, out: Path, kind: str = "ema") -> Path:
    """Write :func:`full_lora_state` of ``tag_dir`` into the folder ``out`` (``lora.safetensors`` with
    the record also in its metadata, ``lora.json`` and, for Wan, the same adapters in diffusers'
    keys, ``pytorch_lora_weights.safetensors``: :func:`vitp.models.lora_files.to_diffusers_lora`);
    returns ``out``. Raises as
    :func:`full_lora_state`."""
    from vitp.utils import save_safetensors

    state, record = full_lora_state(tag_dir, kind)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, str(out / STATE), metadata={"format": "pt", "vitp_lora": json.dumps(record)})
    if record.get("family", "wan") == "wan":  # what WanPipeline.load_lora_weights(out) reads
        from vitp.models import lora_files
        from vitp.models.wan_config import read_config, transformer_folder

        wan = read_config(transformer_folder(record["base"]["folder"], "transformer"))
        lora_files.save_lora_file(out / lora_files.WEIGHT_NAME, *lora_files.to_diffusers_lora(state, record, wan))
    (out / RECORD).write_text(json.dumps({**record, "weights": kind}, indent=2) + "\n")
    return out


__all__ = ["LORA_DIR", "RECORD", "STATE", "full_lora_state", "write_lora"]
