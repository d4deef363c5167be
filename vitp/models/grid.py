"""Token grids of the generator's inputs (torch-free: the config check and the planner use them)."""
from __future__ import annotations

import math
from typing import Any, Tuple

from vitp.config import parse_resolution


def token_grid(image_size: Any, num_frames: int, patch_size: int, tubelet_size: int) -> Tuple[int, int, int]:
    """Token grid ``(gt, gh, gw) = (T / pt, H / p, W / p)`` of an ``image_size`` input: an int
    (square), ``(H, W)`` or ``"HxW"`` (:func:`vitp.config.parse_resolution`)."""
    H, W = parse_resolution(image_size, "model.image_size")
    return num_frames // tubelet_size, H // patch_size, W // patch_size


def _either(a: str, b: str) -> str:
    """``"a or b"``, or ``a`` alone when both are the same."""
    return a if a == b else f"{a} or {b}"


def input_grid(x_shape: Tuple[int, ...], patch_size: int, tubelet_size: int) -> Tuple[int, int, int]:
    """Token grid of an input of shape ``(B, C, T, H, W)``.

    Raises ``ValueError`` when ``T``, ``H`` or ``W`` is not a multiple of its patch size (a
    Conv3d would silently drop the remainder), naming the nearest valid sizes.
    """
    T, H, W = (int(v) for v in x_shape[-3:])
    if T % tubelet_size or H % patch_size or W % patch_size:
        p, pt = patch_size, tubelet_size
        frames = _either(f"{max(pt, T // pt * pt)}", f"{-(-T // pt) * pt}")
        pixels = _either(f"{max(p, H // p * p)}x{max(p, W // p * p)}", f"{-(-H // p) * p}x{-(-W // p) * p}")
        raise ValueError(f"input of {T} frames x {H}x{W} pixels does not tile into ({pt}, {p}, {p}) tubelets; "
                         f"valid sizes near it: frames {frames}, {pixels} pixels")
    return T // tubelet_size, H // patch_size, W // patch_size


def num_tokens(image_size: Any, num_frames: int, patch_size: int, tubelet_size: int, **_) -> int:
    """Tokens per sample ``N = (T / pt) * (H / p) * (W / p)``; extra keyword arguments (the rest
    of a model config, ``num_tokens(**model_cfg)``) are ignored."""
    return math.prod(token_grid(image_size, num_frames, patch_size, tubelet_size))
