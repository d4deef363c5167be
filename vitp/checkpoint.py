"""Checkpoints that survive faults and change layouts.

Two kinds of files:

- **Training checkpoints** (``<run dir>/checkpoints/step_NNNNNNN/``): DeepSpeed's own files
  (per-layer weights, ZeRO optimizer shards, LR scheduler, step counters) plus, per tag,
  ``model_ema.safetensors`` / ``model.safetensors`` (full weights in the export layout below),
  ``rng_rank<R>.pt`` (every RNG stream of rank R) and ``vitp_meta.json`` (step, layout, model
  config, EMA counter, file manifest). A tag is written under ``step_NNNNNNN.partial``; only
  after every rank has finished writing does rank 0 add ``vitp_meta.json``, rename the folder
  and atomically replace the ``latest`` file (same format as DeepSpeed's), so a crash mid-save
  leaves the previous checkpoint as the latest. They resume exactly, but only at the same
  ``(tp, pp, dp)``, model and precision.
- **Exported weights** (``*.safetensors``, format ``vitp.export/1``): full (unsharded) fp32
  tensors; the ViT blocks under timm's ``VisionTransformer`` names and layouts
  (``blocks.N.attn.qkv.weight`` in timm's ``[Q|K|V]`` order, ``blocks.N.mlp.fc1.weight`` ...,
  and ``blocks.N.norm1/norm2`` as the identity affine LayerNorms they are), generator-only
  tensors (patch/time/class embedders, adaLN modulation, final layer) under ``gen.``, and the
  model config as JSON metadata (plus a sidecar ``.json``). They load into any ``(tp, pp)``
  (``trainer.init_from``), into a single process (``vitp-sample``), and their blocks into a
  stock ``timm`` ViT with strict key matching.

Loading never unpickles arbitrary objects: safetensors files carry no code, and ``torch.load``
runs with ``weights_only=True`` (DeepSpeed's files too, through :class:`SafeCheckpointEngine`,
with DeepSpeed's three plain data classes allow-listed).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("vitp")

FORMAT = "vitp.export/1"
META = "vitp_meta.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step_(\d{7,})$")
# model keys that change parameter shapes or names: must match to load weights
ARCH_KEYS = ("in_channels", "num_classes", "patch_size", "tubelet_size", "width", "depth", "num_heads",
             "mlp_ratio", "mlp", "qkv_bias", "qk_norm", "layer_scale_init")
# ... and those that change the computation (resuming must match them too)
RESUME_KEYS = ARCH_KEYS + ("image_size", "num_frames", "attention")
KILL_HOOK = "VITP_TEST_KILL_DURING_SAVE"  # "<rank>:<step>": that rank truncates a file and SIGKILLs itself


def tag_name(step: int) -> str:
    return f"step_{step:07d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _model_dict(model_cfg: Any) -> Dict[str, Any]:
    if isinstance(model_cfg, DictConfig):
        return OmegaConf.to_container(model_cfg, resolve=True)
    return dict(model_cfg)


def _differences(a: Dict[str, Any], b: Dict[str, Any], keys: Iterable[str]) -> List[str]:
    return [f"model.{k}: {a.get(k)!r} in the file vs {b.get(k)!r} now" for k in keys if a.get(k) != b.get(k)]


# ----------------------------------------------------------------------------------------------
# Export layout
# ----------------------------------------------------------------------------------------------
def _is_timm_block_key(key: str) -> bool:
    return key.startswith("blocks.") and ".adaLN_modulation." not in key


def to_export_state(gen_state: Dict[str, torch.Tensor], model_cfg: Any) -> Dict[str, torch.Tensor]:
    """:class:`~vitp.models.Generator` state dict -> export layout (full fp32 tensors).

    ViT block tensors keep their (timm) names; ``blocks.N.norm1/norm2.weight`` = 1 and ``.bias`` = 0
    of shape ``(width,)`` are added (the generator's norms are affine-free, which is exactly that
    affine), everything else gets the prefix ``gen.``.
    """
    m = _model_dict(model_cfg)
    out = {}
    for k, v in gen_state.items():
        out[k if _is_timm_block_key(k) else "gen." + k] = v.detach().float().contiguous().cpu()
    for i in range(m["depth"]):
        for n in ("norm1", "norm2"):
            out[f"blocks.{i}.{n}.weight"] = torch.ones(m["width"])
            out[f"blocks.{i}.{n}.bias"] = torch.zeros(m["width"])
    return out


def from_export_state(export: Dict[str, torch.Tensor], source: str = "file") -> Dict[str, torch.Tensor]:
    """Export layout -> :class:`~vitp.models.Generator` state dict.

    Raises ``ValueError`` if a block norm is not the identity affine (the generator cannot hold it).
    """
    out = {}
    for k, v in export.items():
        if re.match(r"^blocks\.\d+\.norm[12]\.(weight|bias)$", k):
            want = 1.0 if k.endswith("weight") else 0.0
            if not torch.all(v == want):
                raise ValueError(f"{source}: {k} is not {want:g} everywhere; the generator's block norms are "
                                 f"affine-free (adaLN modulates them), so this file cannot be loaded exactly")
            continue
        out[k[4:] if k.startswith("gen.") else k] = v
    return out


def save_export(path: str | os.PathLike, gen_state: Dict[str, torch.Tensor], cfg: DictConfig, *,
                step: Optional[int] = None, weights: str = "ema") -> Path:
    """Write ``gen_state`` (Generator keys, full tensors) as an export file plus ``<stem>.json``.

    Atomic: written under a temporary name in the same folder, then renamed.
    Metadata: ``format``, ``vitp_model`` (model config JSON), ``vitp_config`` (the run config),
    ``step``, ``weights`` (``ema`` | ``raw``).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    meta = {"format": FORMAT, "vitp_model": json.dumps(cfg_dict["model"]), "vitp_config": json.dumps(cfg_dict),
            "step": str(step if step is not None else -1), "weights": weights}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(to_export_state(gen_state, cfg.model), str(tmp), metadata=meta)
    os.replace(tmp, path)
    side = {"format": FORMAT, "weights": weights, "step": step, "model": cfg_dict["model"],
            "tensors": str(path.name)}
    _atomic_write_text(path.with_suffix(".json"), json.dumps(side, indent=2) + "\n")
    return path


def read_export(path: str | os.PathLike, keys: Optional[Iterable[str]] = None
                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(Generator state dict, metadata)`` of a vitp weights file; with ``keys`` (Generator keys)
    only those tensors are read (a pipeline stage needs only its own layers).

    Also reads the older layout (Generator keys, ``vitp_config`` metadata only).
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, truncated,
    corrupt, or not written by vitp.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            exported = meta.get("format") == FORMAT
            if keys is not None and "vitp_config" in meta:
                name = (lambda k: k if _is_timm_block_key(k) else "gen." + k) if exported else (lambda k: k)
                return {k: f.get_tensor(name(k)) for k in keys}, meta
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"weights file {path} is corrupt, truncated or not a safetensors file: {e}") from e
    if "vitp_config" not in meta:
        raise ValueError(f"weights file {path} has no vitp_config metadata: it was not written by vitp "
                         f"(a timm ViT state dict loads with trainer.init_from_timm)")
    return (from_export_state(tensors, str(path)) if exported else tensors), meta


# ----------------------------------------------------------------------------------------------
# Loading full (Generator-keyed) weights into this rank's shard of the pipeline
# ----------------------------------------------------------------------------------------------
def gen_key(pipe_name: str, depth: int) -> str:
    """:class:`~vitp.models.Generator` key of a ``PipelineModule`` parameter name (``"<layer>.<name>"``)."""
    from .models import Generator

    idx, rest = pipe_name.split(".", 1)
    return Generator.layer_prefix(int(idx), depth) + rest


def full_shape(param: torch.Tensor, state: Any) -> Tuple[int, ...]:
    """Shape of the full (unsharded) tensor of a possibly TP-sharded parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
        shape[param.partition_dim] *= state.tp_size
    return tuple(shape)


def load_full_into_pipeline(module: torch.nn.Module, full: Dict[str, torch.Tensor], state: Any, depth: int, *,
                            source: str, strict: bool = True) -> Dict[str, List[str]]:
    """Copy Generator-keyed full tensors into this rank's (stage, TP shard) parameters.

    Returns ``{"loaded": [...], "missing": [...]}`` (Generator keys of this rank's parameters).
    Raises ``ValueError`` naming the key and both shapes on a shape mismatch, and, with
    ``strict``, naming the missing keys.
    """
    from .parallel import shard_like

    loaded, missing = [], []
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = gen_key(name, depth)
            if key not in full:
                missing.append(key)
                continue
            want = full_shape(p, state)
            if tuple(full[key].shape) != want:
                raise ValueError(f"{source}: {key} has shape {tuple(full[key].shape)} but the model expects {want}")
            p.copy_(shard_like(p, full[key].to(p.dtype), state))
            loaded.append(key)
    if strict and missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors of this model, e.g. {missing[:4]}: "
                         f"it was written for another model config")
    return {"loaded": loaded, "missing": missing}


def check_model_matches(file_model: Dict[str, Any], model_cfg: Any, keys: Iterable[str], source: str, fix: str) -> None:
    """Raise ``ValueError`` listing every ``keys`` entry where the file's model config differs."""
    diffs = _differences(file_model, _model_dict(model_cfg), keys)
    if diffs:
        raise ValueError(f"{source} was written for another model ({'; '.join(diffs)}); {fix}")


def load_timm_state(path: str | os.PathLike) -> Dict[str, torch.Tensor]:
    """A timm ViT state dict from ``.safetensors`` or a ``torch.save`` file (``weights_only=True``);
    unwraps ``{"state_dict"|"model"|"module": ...}`` and a ``module.`` key prefix.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"timm checkpoint {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"timm checkpoint {path} could not be read safely (corrupt, or holds more than "
                         f"tensors and plain containers): {e}") from e
    for k in ("state_dict", "model", "module"):
        if isinstance(sd, dict) and isinstance(sd.get(k), dict):
            sd = sd[k]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"timm checkpoint {path} is not a state dict of tensors")
    return {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()}


def timm_block_state(timm_sd: Dict[str, torch.Tensor], depth: int, source: str) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The Generator-keyed block tensors found in a timm ViT state dict, and the unused keys.

    ``blocks.N.norm1/norm2`` affine parameters are unused (the generator's norms are affine-free).
    Raises ``ValueError`` when no block tensor is present.
    """
    used, unused = {}, []
    for k, v in timm_sd.items():
        m = re.match(r"^blocks\.(\d+)\.(.+)$", k)
        if m and int(m.group(1)) < depth and not re.match(r"^norm[12]\.", m.group(2)):
            used[k] = v
        else:
            unused.append(k)
    if not used:
        raise ValueError(f"{source} holds no ViT block tensors (blocks.N.attn.* / blocks.N.mlp.*): "
                         f"is it a timm VisionTransformer state dict?")
    return used, unused


# ----------------------------------------------------------------------------------------------
# Safe DeepSpeed loading
# ----------------------------------------------------------------------------------------------
def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def install_safe_loading(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` read every file with ``torch.load(weights_only=True)``
    (DeepSpeed's own engine uses ``weights_only=False``), naming the file on failure."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine with ``weights_only=True`` loads."""

        def load(self, path: str, map_location=None):
            try:
                with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as e:
                raise ValueError(f"checkpoint file {path} could not be loaded (truncated, corrupt, or holding "
                                 f"objects other than tensors): {type(e).__name__}: {str(e)[:300]}") from e

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"unexpected DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__}; "
                         f"vitp needs the default torch engine")
    safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
    safe.__dict__.update(engine.checkpoint_engine.__dict__)
    engine.checkpoint_engine = safe


# ----------------------------------------------------------------------------------------------
# RNG streams
# ----------------------------------------------------------------------------------------------
def rng_state() -> Dict[str, Any]:
    """Every RNG stream of this process as tensors / plain containers (``weights_only``-loadable)."""
    from .parallel.random import get_rng_tracker

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: Dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    from .parallel.random import get_rng_tracker

    torch.set_rng_state(s["torch"])
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    get_rng_tracker().set_states(s["tracker"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


# ----------------------------------------------------------------------------------------------
# Save / publish / find / verify
# ----------------------------------------------------------------------------------------------
def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _maybe_die(rank: int, step: int, folder: Path) -> None:
    """Fault-injection hook for tests: truncate this rank's largest file and SIGKILL the process."""
    hook = os.environ.get(KILL_HOOK)
    if not hook or hook != f"{rank}:{step}":
        return
    files = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    if files:
        with open(files[-1], "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def save_training_checkpoint(engine: Any, ckpt_dir: Path, step: int, *, rank: int, main: bool, meta: Dict[str, Any],
                             full_states: Any, cfg: DictConfig, keep: int) -> Optional[Tuple[dict, dict]]:
    """Save, then publish, checkpoint ``step_<step>`` under ``ckpt_dir`` (collective: every rank calls it).

    ``full_states()`` is the collective that gathers ``(ema, raw)`` Generator-keyed full weights on
    rank 0. Returns them on rank 0 (``None`` elsewhere). ``keep`` > 0 deletes all but the newest
    ``keep`` published checkpoints (never the latest).
    """
    tag = tag_name(step)
    partial = ckpt_dir / f"{tag}.partial"
    if main:
        if partial.exists():
            shutil.rmtree(partial)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=partial.name, save_latest=False)
    torch.save(rng_state(), partial / f"rng_rank{rank:05d}.pt")
    ema, raw = full_states()
    if main:
        save_export(partial / "model_ema.safetensors", ema, cfg, step=step, weights="ema")
        save_export(partial / "model.safetensors", raw, cfg, step=step, weights="raw")
    _maybe_die(rank, step, partial)
    _barrier()  # every rank has finished writing
    if main:
        manifest = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        _atomic_write_text(partial / META, json.dumps({**meta, "step": step, "manifest": manifest}, indent=1) + "\n")
        final = ckpt_dir / tag
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _atomic_write_text(ckpt_dir / LATEST, tag)
        if keep > 0:
            for old in published_tags(ckpt_dir)[:-keep]:
                shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    _barrier()
    return (ema, raw) if main else None


def published_tags(ckpt_dir: Path) -> List[str]:
    """Complete checkpoint tags in ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name) and (p / META).is_file()]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))


def _fix_hint(tag_dir: Path) -> str:
    others = [t for t in published_tags(tag_dir.parent) if t != tag_dir.name]
    if others:
        return (f"; resume from an earlier complete checkpoint with trainer.resume={tag_dir.parent / others[-1]} "
                f"(complete: {', '.join(others)})")
    return "; no other complete checkpoint is in that folder: start a new run dir (or trainer.init_from=<export>)"


def verify_checkpoint(tag_dir: Path) -> Dict[str, Any]:
    """The checkpoint's metadata after checking that every file it lists is present with the size
    it was written with (content errors surface when the file is loaded, naming it).

    Raises ``FileNotFoundError`` (missing tag or file) / ``ValueError`` (wrong size, corrupt
    metadata) naming the file and the fix.
    """
    meta_path = tag_dir / META
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {tag_dir} does not exist" + _fix_hint(tag_dir))
    if not meta_path.is_file():
        raise FileNotFoundError(f"checkpoint {tag_dir} is incomplete ({META} missing): its save never finished"
                                + _fix_hint(tag_dir))
    try:
        meta = json.loads(meta_path.read_text())
        manifest = meta["manifest"]
    except (ValueError, KeyError) as e:
        raise ValueError(f"checkpoint metadata {meta_path} is corrupt: {e}" + _fix_hint(tag_dir)) from e
    for name, size in manifest.items():
        f = tag_dir / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f} is missing" + _fix_hint(tag_dir))
        if f.stat().st_size != size:
            raise ValueError(f"checkpoint file {f} is truncated or was rewritten ({f.stat().st_size} bytes, "
                             f"{size} when written)" + _fix_hint(tag_dir))
    return meta


def find_checkpoint(resume: str, ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint tag folder to resume from, or ``None`` to start at step 0.

    ``resume``: ``auto`` (the ``latest`` in ``ckpt_dir`` if any), ``never``, or a path to a
    checkpoints folder (its ``latest``) or to one tag folder. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the path when it does not hold a complete checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        latest = ckpt_dir / LATEST
        if not latest.is_file():
            return None
        folder = ckpt_dir
    else:
        folder = Path(resume)
        if not folder.exists():
            raise FileNotFoundError(f"trainer.resume={resume}: no such checkpoint folder; use auto, never, or the "
                                    f"path of a checkpoints/ folder or of one checkpoints/step_NNNNNNN/ folder")
        if (folder / META).is_file() or folder.name.endswith(".partial"):
            return folder
        latest = folder / LATEST
        if not latest.is_file():
            raise FileNotFoundError(f"trainer.resume={resume}: neither a checkpoint tag folder ({META}) nor a "
                                    f"checkpoints folder with a '{LATEST}' file")
    tag = latest.read_text().strip()
    if not TAG_RE.match(tag):
        tags = published_tags(folder)
        fix = (f"write the newest complete tag ({tags[-1]}) into it, or pass trainer.resume={folder / tags[-1]}"
               if tags else "no complete checkpoint is in that folder")
        raise ValueError(f"{latest} names {tag!r}, not a vitp checkpoint tag (step_NNNNNNN): {fix}")
    return folder / tag


def check_resumable(meta: Dict[str, Any], tag_dir: Path, cfg: DictConfig, layout: Dict[str, int], precision: str) -> None:
    """Raise ``ValueError`` explaining the fix when the checkpoint's layout, precision, ZeRO stage or
    model differ from this run's."""
    fix = (f"a training checkpoint resumes only at the same layout and model; to change them export the weights "
           f"(vitp-export {tag_dir}) and start a new run dir with trainer.init_from=<export>.safetensors "
           f"(weights only: optimizer and LR schedule restart)")
    mine = {"tp": layout["tp"], "pp": layout["pp"], "dp": layout["dp"], "precision": precision,
            "zero_stage": cfg.parallel.zero_stage}
    diffs = [f"{k}: {meta.get(k)!r} in the checkpoint vs {v!r} now" for k, v in mine.items() if meta.get(k) != v]
    diffs += _differences(meta.get("model", {}), _model_dict(cfg.model), RESUME_KEYS)
    if diffs:
        raise ValueError(f"checkpoint {tag_dir} does not match this run ({'; '.join(diffs)}); {fix}")


def load_training_checkpoint(engine: Any, tag_dir: Path, rank: int) -> None:
    """Load DeepSpeed state (weights, optimizer, LR schedule) and this rank's RNG streams."""
    install_safe_loading(engine)
    path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {tag_dir}")
    rng_file = tag_dir / f"rng_rank{rank:05d}.pt"
    try:
        s = torch.load(str(rng_file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint file {rng_file} could not be loaded: {e}") from e
    set_rng_state(s)


def truncate_log(path: Path, step: int) -> int:
    """Drop lines of a JSONL log whose ``step`` is beyond ``step`` (atomically); returns how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()

    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except ValueError:  # a line cut off by a crash
            return False

    keep = [x for x in lines if x.strip() and kept(x)]
    if len(keep) != len(lines):
        _atomic_write_text(path, "".join(x + "\n" for x in keep))
    return len(lines) - len(keep)
