"""Sample grids and frame strips (PNG / TensorBoard images) and per-class video sample folders.

Grids and strips are float tensors in ``[0, 1]``, channels first, as ``torchvision.utils.save_image``
and TensorBoard's ``SummaryWriter.add_image`` / ``add_images`` take them (``add_video`` needs
moviepy < 2, which is not a dependency: log :func:`frame_strip` images, or write a GIF).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from .video import MIN_SIDE, PathLike, check_video_batch, to_uint8_frames, write_gif, write_mp4


def to_grid(x: torch.Tensor, nrow: int, min_tile: int = 64) -> torch.Tensor:
    """``(B, C, T, H, W)`` in [-1, 1] -> a ``(3, H', W')`` float grid in [0, 1] of the first
    frames, upscaled (nearest) so each tile is at least ``min_tile`` pixels."""
    from torchvision.utils import make_grid

    img = (x[:, :, 0].float() + 1) / 2
    scale = max(1, min_tile // img.shape[-1])
    if scale > 1:
        img = torch.nn.functional.interpolate(img, scale_factor=scale, mode="nearest")
    return make_grid(img.clamp(0, 1), nrow=nrow, padding=2, pad_value=1.0)


def _upscale_tiles(img: torch.Tensor, min_tile: int) -> torch.Tensor:
    scale = max(1, min_tile // img.shape[-1]) if min_tile else 1
    if scale > 1:
        img = img.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    return img


def video_grid(x: torch.Tensor, nrow: int, min_tile: int = 64, padding: int = 2,
               pad_value: float = 1.0) -> torch.Tensor:
    """Videos ``(B, C, T, H, W)`` in ``[-1, 1]`` -> grid frames ``(T, 3, H', W')`` in ``[0, 1]``.

    Frame ``t`` is a grid of all ``B`` samples at time ``t``: ``nrow`` tiles per row (as in
    ``torchvision.utils.make_grid``, so frame 0 equals :func:`to_grid`), tiles
    upscaled (nearest) by ``max(1, min_tile // W)``, ``padding`` pixels of ``pad_value`` around
    and between tiles: ``H' = rows * (h + padding) + padding`` with ``rows = ceil(B / nrow)``,
    ``W' = min(nrow, B) * (w + padding) + padding`` (``h, w`` after the upscale).
    """
    check_video_batch(x)
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    B, _, T = x.shape[:3]
    img = _upscale_tiles(((x.detach().float().cpu() + 1) / 2).clamp(0, 1), min_tile)
    img = img.expand(-1, 3, -1, -1, -1)
    h, w = img.shape[-2:]
    cols, rows = min(nrow, B), math.ceil(B / min(nrow, B))
    grid = torch.full((T, 3, rows * (h + padding) + padding, cols * (w + padding) + padding), float(pad_value))
    for i in range(B):
        r, c = divmod(i, cols)
        y0, x0 = padding + r * (h + padding), padding + c * (w + padding)
        grid[:, :, y0:y0 + h, x0:x0 + w] = img[i].transpose(0, 1)
    return grid


def frame_strip(x: torch.Tensor, padding: int = 0, pad_value: float = 1.0, min_tile: int = 0) -> torch.Tensor:
    """Frames side by side, for TensorBoard: ``(C, T, H, W)`` -> ``(3, H, T * W)`` (for
    ``add_image``), or a batch ``(B, C, T, H, W)`` -> ``(B, 3, H, T * W)`` (for ``add_images``,
    e.g. one strip per sample of a class row). Float in ``[0, 1]``; grey is replicated to RGB.

    With ``padding > 0`` a ``pad_value`` gap of that many pixels separates frames (width
    ``T * W + (T - 1) * padding``); ``min_tile`` upscales frames (nearest) as in :func:`video_grid`.
    """
    single = isinstance(x, torch.Tensor) and x.dim() == 4
    xb = x.unsqueeze(0) if single else x
    check_video_batch(xb, "x (C, T, H, W) or (B, C, T, H, W)")
    img = _upscale_tiles(((xb.detach().float().cpu() + 1) / 2).clamp(0, 1), min_tile).expand(-1, 3, -1, -1, -1)
    B, _, T, h, w = img.shape
    out = torch.full((B, 3, h, T * w + (T - 1) * padding), float(pad_value))
    for t in range(T):
        out[..., t * (w + padding):t * (w + padding) + w] = img[:, :, t]
    return out[0] if single else out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", str(name)).strip("-.")[:40]


def write_video_samples(x: torch.Tensor, labels: Union[torch.Tensor, Sequence[int]], out_dir: PathLike, *,
                        step: Optional[int] = None, name: Optional[str] = None, fps: float = 8,
                        class_names: Optional[Sequence[str]] = None, fmt: str = "gif",
                        min_side: int = MIN_SIDE, min_tile: int = 64, prefix: str = "class") -> List[Path]:
    """Write one file per sample and one grid; returns the written paths (samples in input
    order, the grid last).

    ``x``: ``(B, C, T, H, W)`` in ``[-1, 1]``; ``labels``: ``B`` class indices. The folder is
    ``out_dir/step_{step:07d}`` (e.g. ``samples/step_0000500``), or ``out_dir/name``, or
    ``out_dir`` itself when neither is given. Sample ``i`` is ``class{c}_seed{k}.{fmt}`` where
    ``k`` counts earlier samples of class ``c`` (the k-th fixed seed of that class); with
    ``class_names`` it is ``class{c}_{slug(name)}_seed{k}.{fmt}``; ``prefix`` replaces ``class``
    (``"prompt"``: vitp-sample's prompt rows, numbered as its ``prompts.txt``). The grid ``grid.{fmt}`` has one
    row per class (in order of first appearance), its samples left to right, blank (white) tiles
    where a class has fewer samples than the largest one. ``fmt``: ``"gif"`` or ``"mp4"``.

    Raises ``ValueError`` for bad shapes, a label count that differs from ``B``, both ``step``
    and ``name``, or an unknown ``fmt``.
    """
    check_video_batch(x)
    if fmt not in ("gif", "mp4"):
        raise ValueError(f"fmt must be 'gif' or 'mp4', got {fmt!r}")
    if step is not None and name is not None:
        raise ValueError("give step or name, not both")
    labels = [int(v) for v in (labels.tolist() if isinstance(labels, torch.Tensor) else labels)]
    if len(labels) != x.shape[0]:
        raise ValueError(f"got {len(labels)} labels for {x.shape[0]} samples")
    folder = Path(out_dir)
    if step is not None:
        folder = folder / f"step_{int(step):07d}"
    elif name is not None:
        folder = folder / name
    write = write_gif if fmt == "gif" else write_mp4

    frames = to_uint8_frames(x)
    counts: Dict[int, int] = {}
    rows: Dict[int, List[int]] = {}
    paths: List[Path] = []
    for i, c in enumerate(labels):
        k = counts.get(c, 0)
        counts[c] = k + 1
        rows.setdefault(c, []).append(i)
        cname = f"_{_slug(class_names[c])}" if class_names is not None and 0 <= c < len(class_names) else ""
        paths.append(write(folder / f"{prefix}{c}{cname}_seed{k}.{fmt}", frames[i], fps=fps, min_side=min_side))

    per = max(counts.values())
    blank = torch.ones_like(x[:1])
    tiles = torch.cat([torch.cat([x[idx]] + [blank] * (per - len(idx))) for idx in rows.values()])
    grid = (video_grid(tiles, nrow=per, min_tile=min_tile) * 255).round().to(torch.uint8)
    paths.append(write(folder / f"grid.{fmt}", grid.permute(0, 2, 3, 1).numpy(), fps=fps, min_side=min_side))
    return paths


def caption_rows(grid: torch.Tensor, captions: Sequence[str], width: int = 0) -> torch.Tensor:
    """A grid ``(3, H', W')`` in [0, 1] with ``len(captions)`` rows (:func:`to_grid`) and a white
    band on its left holding each row's caption (Pillow's default font, cut to fit): the sample
    grids of a text-conditional model name their prompts. ``width``: band width in pixels
    (0: from the longest caption, at most 360)."""
    from PIL import Image, ImageDraw

    rows = max(1, len(captions))
    img = Image.fromarray((grid.permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype("uint8"))
    font = _label_font()
    draw = ImageDraw.Draw(img)
    longest = max((draw.textlength(c, font=font) for c in captions), default=0)
    band = width or int(min(360, longest + 12))
    out = Image.new("RGB", (img.width + band, img.height), (255, 255, 255))
    out.paste(img, (band, 0))
    draw = ImageDraw.Draw(out)
    step = img.height / rows
    for r, text in enumerate(captions):
        while text and draw.textlength(text, font=font) > band - 8:
            text = text[:-4] + "..." if len(text) > 4 else ""
        draw.text((4, int((r + 0.5) * step) - 6), text, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1).float() / 255


def _label_font(size: int = 11):
    """DejaVu Sans from matplotlib's font files (any Unicode Latin text), else Pillow's default."""
    from PIL import ImageFont

    try:
        from matplotlib import font_manager

        return ImageFont.truetype(font_manager.findfont("DejaVu Sans", fallback_to_default=False), size)
    except Exception:  # noqa: BLE001 - no matplotlib font: Pillow's own
        return ImageFont.load_default()
