"""Writing and reading video files: animated GIF (Pillow) and MP4 (PyAV's bundled FFmpeg).

Conventions:

- A batch of videos is a tensor ``(B, C, T, H, W)``, float, in ``[-1, 1]`` (``C`` is 1 or 3);
  one video is ``(C, T, H, W)``. An image is a video with ``T = 1``.
- Frames for the encoders are ``numpy`` ``uint8`` arrays ``(T, H, W, 3)`` (RGB, 0..255).

Every writer is atomic (:func:`vitp.utils.atomic_write`): a crash or an encoder error never
leaves a partial file under the final name (an older file there stays intact) nor a temporary
file behind.

Encoders: GIF with Pillow (animated, looping, one adaptive 256-colour palette per frame, or an
exact grey palette when the frames are grey); MP4 with PyAV's bundled FFmpeg, H.264 (``libx264``)
when the build has it, else MPEG-4 part 2 (``mpeg4``), ``yuv420p``.
"""
from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path
from typing import List, Optional, Union

import numpy as np
import torch

from vitp.utils import atomic_write

__all__ = ["to_uint8_frames", "write_gif", "write_mp4", "read_video_frames", "displayed_frame", "display_orientation",
           "video_orientation", "scene_cuts",
           "check_video_batch", "MIN_SIDE"]

PathLike = Union[str, "os.PathLike[str]"]
Frames = Union[np.ndarray, torch.Tensor]

#: Default smallest side (pixels) of a written GIF/MP4: tiny samples are upscaled to it.
MIN_SIDE = 128


# conversions


def check_video_batch(x: torch.Tensor, name: str = "x") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``x`` is a ``(B, C, T, H, W)`` tensor with C in (1, 3)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[1] not in (1, 3):
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{name} must be a (B, C, T, H, W) tensor with C = 1 or 3, got {shape}")


def to_uint8_frames(x: torch.Tensor) -> np.ndarray:
    """Videos ``(B, C, T, H, W)`` in ``[-1, 1]`` -> ``uint8`` frames ``(B, T, H, W, 3)``.

    Values are clamped to ``[-1, 1]`` and mapped to ``0..255`` by ``round((x + 1) / 2 * 255)``;
    grayscale (``C = 1``) is replicated to RGB. Raises ``ValueError`` for any other shape.
    """
    check_video_batch(x)
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
    with atomic_write(path) as tmp:
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
    with atomic_write(path) as tmp:
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


# Array operations that turn a decoded frame (H, W, ...) upright, named as FFmpeg's filters.
_ORIENT = {
    "clock": lambda a: np.rot90(a, -1),  # transpose=clock: 90 degrees clockwise
    "cclock": lambda a: np.rot90(a, 1),  # 90 degrees counter-clockwise
    "cclock_flip": lambda a: a.swapaxes(0, 1),  # transpose (90 counter-clockwise, then vertical flip)
    "clock_flip": lambda a: a[::-1, ::-1].swapaxes(0, 1),  # anti-transpose (90 clockwise, then vertical flip)
    "hflip": lambda a: a[:, ::-1],
    "vflip": lambda a: a[::-1],
    "hflip,vflip": lambda a: a[::-1, ::-1],  # 180 degrees
}
SWAPS_SIDES = ("clock", "cclock", "cclock_flip", "clock_flip")


def display_orientation(frame) -> Optional[str]:
    """How a player turns a decoded PyAV ``VideoFrame`` upright: ``None`` (shown as coded) or a key
    of ``_ORIENT`` (those in ``SWAPS_SIDES`` swap width and height).

    Read from the frame's display matrix (``AV_FRAME_DATA_DISPLAYMATRIX``, which FFmpeg copies
    from the container, e.g. an MP4 ``tkhd`` matrix written by a phone held upright) and decided
    exactly as ffplay's and ffmpeg's ``autorotate`` do: rotations by multiples of 90 degrees with
    their mirrorings. Other angles (rare) are left as coded.

    Call it on a frame whose pixels are not converted (once per file, e.g. on the first frame, as
    :func:`video_orientation` does): ``frame.side_data`` ties the frame into a reference cycle
    that only the garbage collector frees, and a converted frame holds a swscale context with
    threads; freed in a forked DataLoader worker, that context waits forever for its threads.
    """
    sd = frame.side_data.get("DISPLAYMATRIX")
    if sd is None:
        return None
    m = np.frombuffer(bytes(sd), dtype=np.int32)  # 3x3, row-major, 16.16 fixed point (native order)
    theta = -float(frame.rotation) % 360  # clockwise degrees (frame.rotation is counter-clockwise)
    if abs(theta - 90) < 1:
        return "cclock_flip" if m[3] > 0 else "clock"
    if abs(theta - 180) < 1:
        flips = [name for name, neg in (("hflip", m[0] < 0), ("vflip", m[4] < 0)) if neg]
        return ",".join(flips) or None
    if abs(theta - 270) < 1:
        return "clock_flip" if m[3] < 0 else "cclock"
    return "vflip" if min(theta, 360 - theta) < 1 and m[4] < 0 else None


def video_orientation(path: PathLike) -> Optional[str]:
    """:func:`display_orientation` of the first frame of the first video stream of ``path``
    (``None`` when there is none). Raises what PyAV raises for an unreadable file."""
    import av

    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            return display_orientation(frame)
    return None


def displayed_frame(frame, orientation: Optional[str], format: str = "rgb24") -> np.ndarray:
    """``frame.to_ndarray(format=format)`` (e.g. ``(H, W, 3)`` uint8 for ``rgb24``, ``(H, W)`` for
    ``gray``) turned by ``orientation`` (:func:`display_orientation` of the file); C-contiguous."""
    arr = frame.to_ndarray(format=format)
    return arr if orientation is None else np.ascontiguousarray(_ORIENT[orientation](arr))


def read_video_frames(path: PathLike) -> np.ndarray:
    """Decode a video or animated GIF into ``uint8`` RGB frames ``(T, H, W, 3)``.

    GIFs are read with Pillow (each frame fully composited), everything else with PyAV, in
    presentation order and turned as players show them (:func:`video_orientation`).
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
            orientation = video_orientation(path)
            with av.open(str(path)) as container:
                out = [displayed_frame(f, orientation) for f in container.decode(video=0)]
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, av.error.InvalidDataError, ...
        raise ValueError(f"cannot decode video file {path}: {e}") from e
    if not out:
        raise ValueError(f"video file {path} holds no frames")
    return np.stack(out)


def scene_cuts(path: PathLike, threshold: float = 10.0) -> List[int]:
    """Frames that start a new shot: FFmpeg's ``scdet`` filter (through PyAV's filter graph) on
    every decoded frame of the first video stream.

    ``threshold`` is ``scdet``'s, in percent of the largest possible change between two frames,
    in ``(0, 100]`` (FFmpeg's default 10; its documentation calls 8-14 good values). Returns the
    indices ``i`` (frame ``i`` = the ``i``-th frame the decoder outputs, as
    :func:`vitp.data.video.probe_video` numbers them) of the frames that differ from frame
    ``i - 1`` by more than ``threshold``: a clip containing frames ``i - 1`` and ``i`` straddles a
    cut. Raises ``ValueError`` for a bad threshold or a file that cannot be decoded or filtered.

    Source: FFmpeg filter documentation, ``scdet`` (https://ffmpeg.org/ffmpeg-filters.html#scdet);
    PyAV ``av.filter.Graph`` (``add_buffer``, ``push``, ``pull``).
    """
    if not 0 < float(threshold) <= 100:
        raise ValueError(f"the scene-cut threshold is a percentage in (0, 100], got {threshold}")
    import av

    cuts: List[int] = []
    index = 0
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            graph = av.filter.Graph()
            src = graph.add_buffer(template=stream)
            scdet = graph.add("scdet", f"threshold={float(threshold)}")
            sink = graph.add("buffersink")
            src.link_to(scdet)
            scdet.link_to(sink)
            graph.configure()

            def drain() -> None:
                nonlocal index
                while True:
                    try:
                        out = graph.pull()
                    except (av.BlockingIOError, av.EOFError):
                        return
                    if index > 0 and "lavfi.scd.time" in out.metadata:
                        cuts.append(index)
                    index += 1

            for frame in container.decode(stream):
                graph.push(frame)
                drain()
            graph.push(None)  # flush the filter
            drain()
    except Exception as e:  # noqa: BLE001 - av.error.*, IndexError (no video stream)
        raise ValueError(f"cannot detect scene cuts in {path}: {type(e).__name__}: {e}") from e
    return cuts
