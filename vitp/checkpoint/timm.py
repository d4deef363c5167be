"""Reading a timm ViT state dict (``.pth`` / ``.safetensors``) for ``trainer.init_from_timm``."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Tuple

import torch


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
