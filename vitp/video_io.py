"""Video previews (GIF, MP4, frame grids and strips) and a temporal statistic for video evaluation.

Conventions, shared with :mod:`vitp.evaluate`:

- A batch of videos is a tensor ``(B, C, T, H, W)``, float, in ``[-1, 1]`` (``C`` is 1 or 3);
  one video is ``(C, T, H, W)``. An image is a video with ``T = 1``.
- Frames for the encoders are ``numpy`` ``uint8`` arrays ``(T, H, W, 3)`` (RGB, 0..255).
- Grids and strips for TensorBoard are float tensors in ``[0, 1]``, channels first, as
  ``SummaryWriter.add_image`` / ``add_images`` take them. TensorBoard's ``add_video`` needs
  moviepy < 2, which is not a dependency: log :func:`frame_strip` images, or write a GIF.

Every writer is atomic: it encodes to a hidden temporary name in the destination folder and
``os.replace``-s it onto the final name, so a crash or an encoder error never leaves a partial
file under the final name (an older file there stays intact) nor a temporary file behind.

Encoders: GIF with Pillow (animated, looping, one adaptive 256-colour palette per frame, or an
exact grey palette when the frames are grey); MP4 with PyAV's bundled FFmpeg, H.264 (``libx264``)
when the build has it, else MPEG-4 part 2 (``mpeg4``), ``yuv420p``.
"""
from __future__ import annotations

import math
import os
import re
import uuid
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

__all__ = [
    "to_uint8_frames", "write_gif", "write_mp4", "read_video_frames", "video_grid", "frame_strip",
    "write_video_samples", "temporal_consistency", "temporal_metrics",
]

PathLike = Union[str, "os.PathLike[str]"]
Frames = Union[np.ndarray, torch.Tensor]

#: Default smallest side (pixels) of a written GIF/MP4: tiny samples are upscaled to it.
MIN_SIDE = 128


# --------------------------------------------------------------------------------------------
# conversions


def _check_video_batch(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[1] not in (1, 3):
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{name} must be a (B, C, T, H, W) tensor with C = 1 or 3, got {shape}")


def to_uint8_frames(x: torch.Tensor) -> np.ndarray:
    """Videos ``(B, C, T, H, W)`` in ``[-1, 1]`` -> ``uint8`` frames ``(B, T, H, W, 3)``.

    Values are clamped to ``[-1, 1]`` and mapped to ``0..255`` by ``round((x + 1) / 2 * 255)``;
    grayscale (``C = 1``) is replicated to RGB. Raises ``ValueError`` for any other shape.
    """
    _check_video_batch(x)
    u8 = ((x.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if u8.shape[1] == 1:
        u8 = u8.expand(-1, 3, -1, -1, -1)
    return u8.permute(0, 2, 3, 4, 1).contiguous().numpy()


def _as_frames(frames: Frames) -> np.ndarray:
    """``(T, H, W, 3)`` uint8 from either ``uint8`` frames ``(T, H, W, 3)`` / ``(T, H, W)``
    (grey) or one float video ``(C, T, H, W)`` in ``[-1, 1]``."""
    if isinstance(frames, torch.Tensor) and frames.is_floating_point():
        if frames.dim() != 4:
            raise ValueError(f"a float video must be (C, T, H, W) in [-1, 1], got shape {tuple(frames.shape)}")
        return to_uint8_frames(frames.unsqueeze(0))[0]
    arr = frames.detach().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if arr.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3) or a float (C, T, H, W) tensor in [-1, 1], "
                         f"got dtype {arr.dtype} shape {arr.shape}")
    if arr.ndim == 3:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"uint8 frames must be (T, H, W, 3) or (T, H, W), got shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 1 or arr.shape[2] < 1:
        raise ValueError(f"frames must hold at least one non-empty frame, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def _upscale(frames: np.ndarray, scale: Optional[int], min_side: int) -> np.ndarray:
    """Nearest-neighbour integer upscale; ``scale=None`` picks ``ceil(min_side / min(H, W))``."""
    if scale is None:
        scale = max(1, math.ceil(min_side / min(frames.shape[1:3])))
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a positive integer (or None for automatic), got {scale!r}")
    if scale > 1:
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
    return frames


def _check_fps(fps: float) -> None:
    if not (isinstance(fps, (int, float, Fraction)) and math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r}")


@contextmanager
def _atomic(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` (same suffix, hidden name); on success replace
    ``path`` by it, on any exception delete it and re-raise. Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# writers and reader


def gif_frame_ms(fps: float) -> int:
    """Per-frame delay written for ``fps``: GIF stores centiseconds, so ``1000 / fps`` is rounded
    to a multiple of 10 ms, at least 20 ms (browsers slow shorter delays to 100 ms)."""
    _check_fps(fps)
    return max(20, 10 * round(100 / fps))


def write_gif(path: PathLike, frames: Frames, fps: float = 8, scale: Optional[int] = None,
              min_side: int = MIN_SIDE) -> Path:
    """Write an animated, looping GIF; returns ``Path(path)``.

    ``frames``: ``uint8`` ``(T, H, W, 3)`` (or ``(T, H, W)`` grey), or one float video tensor
    ``(C, T, H, W)`` in ``[-1, 1]``. Frames are upscaled with nearest neighbour by the integer
    ``scale``; ``None`` picks the smallest factor that makes the shorter side >= ``min_side``
    pixels (a 32 px sample becomes 128 px). Each frame shows for :func:`gif_frame_ms` ``(fps)``.

    Pillow gives each RGB frame its own adaptive 256-colour palette (lossy for photos, exact
    for few colours); frames with R = G = B everywhere use an exact 256-grey palette. Pillow
    merges *identical consecutive* frames into one longer frame (timing kept), so a GIF can
    decode to fewer frames than were written: compute statistics on the tensors, not on GIFs.

    Atomic (see the module docstring). Raises ``ValueError`` for bad shapes, dtypes, fps, scale.
    """
    from PIL import Image

    arr = _upscale(_as_frames(frames), scale, min_side)
    duration = gif_frame_ms(fps)
    grey = bool((arr[..., 0] == arr[..., 1]).all() and (arr[..., 0] == arr[..., 2]).all())
    ims = [Image.fromarray(f[..., 0] if grey else f, mode="L" if grey else "RGB") for f in arr]
    with _atomic(path) as tmp:
        with open(tmp, "wb") as fp:
            ims[0].save(fp, format="GIF", save_all=True, append_images=ims[1:], duration=duration, loop=0)
    return Path(path)


def _pick_codec(codec: Optional[str]) -> str:
    import av

    candidates = [codec] if codec else ["libx264", "mpeg4"]
    for name in candidates:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:
            continue
    raise ValueError(f"no usable video encoder among {candidates} in this PyAV/FFmpeg build")


def write_mp4(path: PathLike, frames: Frames, fps: float = 8, scale: Optional[int] = None,
              min_side: int = MIN_SIDE, codec: Optional[str] = None, crf: int = 18) -> Path:
    """Write an MP4 (or any container FFmpeg infers from the suffix, e.g. ``.mkv``); returns
    ``Path(path)``.

    ``frames`` and the nearest-neighbour upscale (``scale``, ``min_side``) are as in
    :func:`write_gif`. The encoder is ``codec`` if given, else H.264 (``libx264``, constant
    quality ``crf``: 0 lossless .. 51 worst) when available, else MPEG-4 part 2 (``mpeg4``, high
    bit rate). Pixels are ``yuv420p`` (what players expect), which needs even sizes: an odd
    height/width gets one replicated edge row/column at the bottom/right. Lossy: decoded
    frames differ by a few levels (more at sharp colour edges: chroma is half resolution).

    Atomic (see the module docstring). Raises ``ValueError`` for bad input or no encoder.
    """
    import av

    arr = _upscale(_as_frames(frames), scale, min_side)
    _check_fps(fps)
    pad_h, pad_w = arr.shape[1] % 2, arr.shape[2] % 2
    if pad_h or pad_w:
        arr = np.pad(arr, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    name = _pick_codec(codec)
    rate = Fraction(fps).limit_denominator(1001)
    with _atomic(path) as tmp:
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream(name, rate=rate)
            stream.width, stream.height = arr.shape[2], arr.shape[1]
            stream.pix_fmt = "yuv420p"
            if name == "libx264":
                stream.options = {"crf": str(crf), "preset": "medium"}
            else:
                stream.bit_rate = max(2_000_000, int(arr.shape[1] * arr.shape[2] * float(rate) * 4))
            for f in arr:
                for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return Path(path)


def read_video_frames(path: PathLike) -> np.ndarray:
    """Decode a video or animated GIF into ``uint8`` RGB frames ``(T, H, W, 3)``.

    GIFs are read with Pillow (each frame fully composited), everything else with PyAV.
    Raises ``FileNotFoundError`` if ``path`` does not exist and ``ValueError`` if it holds no
    decodable video frames.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file {path} does not exist")
    out: List[np.ndarray] = []
    try:
        if path.suffix.lower() == ".gif":
            from PIL import Image, ImageSequence

            with Image.open(path) as im:
                out = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
        else:
            import av

            with av.open(str(path)) as container:
                if not container.streams.video:
                    raise ValueError("no video stream")
                out = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, av.error.InvalidDataError, ...
        raise ValueError(f"cannot decode video file {path}: {e}") from e
    if not out:
        raise ValueError(f"video file {path} holds no frames")
    return np.stack(out)


# --------------------------------------------------------------------------------------------
# grids and strips


def _upscale_tiles(img: torch.Tensor, min_tile: int) -> torch.Tensor:
    scale = max(1, min_tile // img.shape[-1]) if min_tile else 1
    if scale > 1:
        img = img.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    return img


def video_grid(x: torch.Tensor, nrow: int, min_tile: int = 64, padding: int = 2,
               pad_value: float = 1.0) -> torch.Tensor:
    """Videos ``(B, C, T, H, W)`` in ``[-1, 1]`` -> grid frames ``(T, 3, H', W')`` in ``[0, 1]``.

    Frame ``t`` is a grid of all ``B`` samples at time ``t``: ``nrow`` tiles per row (as in
    ``torchvision.utils.make_grid``, so frame 0 equals :func:`vitp.evaluate.to_grid`), tiles
    upscaled (nearest) by ``max(1, min_tile // W)``, ``padding`` pixels of ``pad_value`` around
    and between tiles: ``H' = rows * (h + padding) + padding`` with ``rows = ceil(B / nrow)``,
    ``W' = min(nrow, B) * (w + padding) + padding`` (``h, w`` after the upscale).
    """
    _check_video_batch(x)
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
    _check_video_batch(xb, "x (C, T, H, W) or (B, C, T, H, W)")
    img = _upscale_tiles(((xb.detach().float().cpu() + 1) / 2).clamp(0, 1), min_tile).expand(-1, 3, -1, -1, -1)
    B, _, T, h, w = img.shape
    out = torch.full((B, 3, h, T * w + (T - 1) * padding), float(pad_value))
    for t in range(T):
        out[..., t * (w + padding):t * (w + padding) + w] = img[:, :, t]
    return out[0] if single else out


# --------------------------------------------------------------------------------------------
# sample folders


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", str(name)).strip("-.")[:40]


def write_video_samples(x: torch.Tensor, labels: Union[torch.Tensor, Sequence[int]], out_dir: PathLike, *,
                        step: Optional[int] = None, name: Optional[str] = None, fps: float = 8,
                        class_names: Optional[Sequence[str]] = None, fmt: str = "gif",
                        min_side: int = MIN_SIDE, min_tile: int = 64) -> List[Path]:
    """Write one file per sample and one grid; returns the written paths (samples in input
    order, the grid last).

    ``x``: ``(B, C, T, H, W)`` in ``[-1, 1]``; ``labels``: ``B`` class indices. The folder is
    ``out_dir/step_{step:07d}`` (e.g. ``samples/step_0000500``), or ``out_dir/name``, or
    ``out_dir`` itself when neither is given. Sample ``i`` is ``class{c}_seed{k}.{fmt}`` where
    ``k`` counts earlier samples of class ``c`` (the k-th fixed seed of that class); with
    ``class_names`` it is ``class{c}_{slug(name)}_seed{k}.{fmt}``. The grid ``grid.{fmt}`` has one
    row per class (in order of first appearance), its samples left to right, blank (white) tiles
    where a class has fewer samples than the largest one. ``fmt``: ``"gif"`` or ``"mp4"``.

    Raises ``ValueError`` for bad shapes, a label count that differs from ``B``, both ``step``
    and ``name``, or an unknown ``fmt``.
    """
    _check_video_batch(x)
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
        paths.append(write(folder / f"class{c}{cname}_seed{k}.{fmt}", frames[i], fps=fps, min_side=min_side))

    per = max(counts.values())
    blank = torch.ones_like(x[:1])
    tiles = torch.cat([torch.cat([x[idx]] + [blank] * (per - len(idx))) for idx in rows.values()])
    grid = (video_grid(tiles, nrow=per, min_tile=min_tile) * 255).round().to(torch.uint8)
    paths.append(write(folder / f"grid.{fmt}", grid.permute(0, 2, 3, 1).numpy(), fps=fps, min_side=min_side))
    return paths


# --------------------------------------------------------------------------------------------
# statistics


@torch.no_grad()
def temporal_consistency(x: torch.Tensor, clamp: bool = True) -> float:
    """Mean absolute difference between consecutive frames, ``mean |x[:, :, t+1] - x[:, :, t]|``
    over all samples, channels, pixels and the ``T - 1`` frame pairs (float64 accumulation).

    ``x``: ``(B, C, T, H, W)`` in ``[-1, 1]`` (clamped first when ``clamp``, as the previews
    are). Units: the ``[-1, 1]`` data range, so the value lies in ``[0, 2]``; multiply by 127.5
    for 8-bit levels. 0 means a static video; a linear ramp ``x_t = a + b t`` gives ``|b|``.
    Not a quality score by itself: compare samples with real clips
    (:func:`temporal_metrics`) -- too low is frozen video, too high is flicker.

    Raises ``ValueError`` for a non-5-D input or fewer than 2 frames.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        raise ValueError(f"temporal_consistency needs a (B, C, T, H, W) tensor, got "
                         f"{tuple(x.shape) if hasattr(x, 'shape') else type(x).__name__}")
    if x.shape[2] < 2:
        raise ValueError(f"temporal_consistency needs at least 2 frames (T >= 2), got T = {x.shape[2]}; "
                         "images (T = 1) have no temporal statistic")
    if x.numel() == 0:
        raise ValueError(f"temporal_consistency got an empty tensor of shape {tuple(x.shape)}")
    v = x.detach().double()
    if clamp:
        v = v.clamp(-1, 1)
    return (v[:, :, 1:] - v[:, :, :-1]).abs().mean().item()


def temporal_metrics(samples: torch.Tensor, real: torch.Tensor) -> Dict[str, float]:
    """:func:`temporal_consistency` of generated ``samples`` and of ``real`` clips (both
    ``(B, C, T, H, W)`` in ``[-1, 1]``, same ``T`` for a fair comparison) and their ratio:

    ``{"temporal_diff": samples, "temporal_diff_real": real, "temporal_diff_ratio": samples / real}``

    A ratio near 1 means samples move as much as real footage; < 1 too static, > 1 flicker.
    The ratio uses ``max(real, 1e-12)`` so static real clips do not divide by zero.
    """
    s, r = temporal_consistency(samples), temporal_consistency(real)
    return {"temporal_diff": s, "temporal_diff_real": r, "temporal_diff_ratio": s / max(r, 1e-12)}
