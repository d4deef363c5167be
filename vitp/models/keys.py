"""The one map between the three key layouts of the generator's weights.

- **pipeline**: ``PipelineModule`` names ``"<layer index>.<name>"``; layer 0 is ``Embed``,
  layers ``1..depth`` the blocks, layer ``depth + 1`` the ``FinalLayer`` (:func:`~vitp.models.generator.layer_specs`);
- **generator**: :class:`~vitp.models.Generator` names ``embed.*``, ``blocks.<i>.*``, ``final.*``;
- **export** (safetensors files): the ViT blocks under timm's ``VisionTransformer`` names
  (``blocks.<i>.attn.qkv.weight`` ...; the affine-free ``norm1``/``norm2`` written as the identity
  affine they equal), everything else under ``gen.`` (``gen.embed.*``, ``gen.blocks.<i>.adaLN_modulation.*``,
  ``gen.final.*``).
"""
from __future__ import annotations

import re
from typing import Dict

import torch

_NORM_KEY = re.compile(r"^blocks\.\d+\.norm[12]\.(weight|bias)$")


def generator_key(pipe_name: str, depth: int) -> str:
    """Generator key of a pipeline name: ``"0.x_embedder.proj.weight"`` -> ``"embed.x_embedder.proj.weight"``."""
    idx, rest = pipe_name.split(".", 1)
    i = int(idx)
    prefix = "embed." if i == 0 else "final." if i == depth + 1 else f"blocks.{i - 1}."
    return prefix + rest


def pipeline_to_generator(pipe_state: Dict[str, torch.Tensor], depth: int) -> Dict[str, torch.Tensor]:
    """Rename a ``PipelineModule`` state (any subset of layers) to generator keys."""
    return {generator_key(k, depth): v for k, v in pipe_state.items()}


def is_timm_block_key(key: str) -> bool:
    """True for generator keys that a timm ``VisionTransformer`` block holds under the same name."""
    return key.startswith("blocks.") and ".adaLN_modulation." not in key and ".cross_attn." not in key


def export_key(gen_key: str) -> str:
    """Export (file) key of a generator key."""
    return gen_key if is_timm_block_key(gen_key) else "gen." + gen_key


def to_export_state(gen_state: Dict[str, torch.Tensor], width: int, depth: int) -> Dict[str, torch.Tensor]:
    """Generator state -> export layout: full fp32 contiguous CPU tensors, and
    ``blocks.<i>.norm1/norm2.weight = 1``, ``.bias = 0`` of shape ``(width,)`` added."""
    out = {export_key(k): v.detach().float().contiguous().cpu() for k, v in gen_state.items()}
    for i in range(depth):
        for n in ("norm1", "norm2"):
            out[f"blocks.{i}.{n}.weight"] = torch.ones(width)
            out[f"blocks.{i}.{n}.bias"] = torch.zeros(width)
    return out


def from_export_state(export: Dict[str, torch.Tensor], source: str = "file") -> Dict[str, torch.Tensor]:
    """Export layout -> generator state.

    Raises ``ValueError`` naming ``source`` if a block norm is not the identity affine (the
    generator's norms are affine-free: adaLN modulates them).
    """
    out = {}
    for k, v in export.items():
        if _NORM_KEY.match(k):
            want = 1.0 if k.endswith("weight") else 0.0
            if not torch.all(v == want):
                raise ValueError(f"{source}: {k} is not {want:g} everywhere; the generator's block norms are "
                                 f"affine-free (adaLN modulates them), so this file cannot be loaded exactly")
            continue
        out[k[4:] if k.startswith("gen.") else k] = v
    return out
