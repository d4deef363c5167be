"""The held-out split a run started with, recorded in its folder and kept when it resumes.

A folder's split (:meth:`vitp.data.video.VideoFolderDataset.heldout_items`,
:func:`vitp.data.base.stratified_split`) is a function of the files found: a file added or
deleted between two launches can move a clip the run trained on into the held-out set, whose
loss would then score training data. ``vitp-train`` writes :data:`RECORD_NAME` into the run
folder when it first trains (the files it found and, per frame count, the keys of its held-out
items) and every later launch keeps that split: recorded held-out items stay held out, items of
recorded files stay in training, and only new files are split by the rule. What changed is logged
as a warning.

A video's clip windows depend on the frame count (a file has more 4-frame windows than 8-frame
ones), so ``file#3`` names another clip at each count: the record holds one split per frame count
the run cuts clips at (``data.num_frames`` and each bucket's ``frames``, :mod:`vitp.data.buckets`).
A record of version 1 (vitp before this) holds ``data.num_frames``' split only: it is read as
that, a frame count it lacks is split by the rule (the first launch's split when no file changed
since; a warning says when files did), and ``vitp-train`` adds the missing counts to the record
(:func:`record_split`), so later launches keep them.

An item's key is its file (relative to ``data.root`` when under it) and, for a video, ``#<window>``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from vitp.utils import atomic_write_text

log = logging.getLogger(__name__)

RECORD_NAME = "heldout_split.json"
_VERSION = 2  # 2: held_out maps a frame count to its keys; 1: one key list, at data.num_frames


def _file_key(path: Any, root: Optional[Path]) -> str:
    p = Path(path)
    if root is not None:
        try:
            return p.relative_to(root).as_posix()
        except ValueError:
            pass
    return p.as_posix()


def item_keys(base: Any, indices: Sequence[int]) -> List[str]:
    """The key of each item ``indices`` of ``base`` (an image or video folder data set):
    ``"<file>"`` or, for video clip windows, ``"<file>#<window>"``."""
    root = getattr(base, "root", None)
    files = [_file_key(p, root) for p in base.files]
    windows = getattr(base, "item_window", None)
    idx = np.asarray(indices, dtype=np.int64)
    if windows is None:
        return [files[base._file_of(int(i))] for i in idx]
    return [f"{files[int(base.item_file[i])]}#{int(windows[i])}" for i in idx]


def split_record(held: Mapping[int, Tuple[Any, Sequence[int]]]) -> Dict[str, Any]:
    """What :func:`write_record` stores: ``{"version", "files": every usable file's key, "held_out":
    {"<frames>": the keys of the held-out items at that frame count}}`` (keys as in
    :func:`item_keys`). ``held`` maps each frame count to ``(base, held-out item indices of base)``;
    the files are those of the first base (every frame count's base lists the folder's files)."""
    base = next(iter(held.values()))[0]
    root = getattr(base, "root", None)
    return {"version": _VERSION, "files": sorted(_file_key(p, root) for p in base.files),
            "held_out": {str(int(t)): sorted(item_keys(b, idx)) for t, (b, idx) in sorted(held.items())}}


def write_record(path: Path, held: Mapping[int, Tuple[Any, Sequence[int]]]) -> None:
    """Write :func:`split_record` of ``held`` to ``path`` (atomically)."""
    atomic_write_text(Path(path), json.dumps(split_record(held)))


def read_record(path: Optional[Path], frames: int) -> Optional[Dict[str, Any]]:
    """The record at ``path`` in the current form (``held_out`` per frame count); ``None`` when
    ``path`` is None or absent. ``frames``: the run's ``data.num_frames``, the frame count of a
    version-1 record's keys (never a bucket's own count: its windows are other clips).

    Raises ``ValueError`` naming the file when it is not a record vitp wrote."""
    if path is None or not Path(path).is_file():
        return None
    try:
        rec = json.loads(Path(path).read_text())
        if isinstance(rec["files"], list):
            if rec.get("version") == 1 and isinstance(rec["held_out"], list):
                return {"version": _VERSION, "files": rec["files"], "held_out": {str(int(frames)): rec["held_out"]},
                        "from_version": 1}
            if rec.get("version") == _VERSION and isinstance(rec["held_out"], dict) and \
                    all(isinstance(v, list) for v in rec["held_out"].values()):
                return rec
    except (ValueError, KeyError, AttributeError, TypeError):
        pass
    raise ValueError(f"{path} is not a held-out split record vitp wrote (damaged?); restore it from a copy of the run, "
                     f"or delete it to split the data again (the held-out loss may then score clips the run trained on)")


def record_split(path: Path, held: Mapping[int, Tuple[Any, Sequence[int]]], frames: int) -> None:
    """Record ``held`` (as :func:`split_record`) at ``path`` the first time; a record already there
    (the run's first launch's) is kept, and only the frame counts it lacks are added (a version-1
    record, or a bucket's frame count added at a resume), with an info line naming them.
    ``frames``: the run's ``data.num_frames`` (:func:`read_record`)."""
    rec = read_record(path, frames)
    if rec is None:
        write_record(path, held)
        return
    missing = {t: h for t, h in held.items() if str(int(t)) not in rec["held_out"]}
    if not missing:
        return
    rec["held_out"].update(split_record(missing)["held_out"])
    rec.pop("from_version", None)
    atomic_write_text(Path(path), json.dumps({"version": _VERSION, "files": rec["files"], "held_out": rec["held_out"]}))
    log.info(f"{RECORD_NAME}: recorded the held-out split at {', '.join(map(str, sorted(missing)))} frame(s) too "
             f"(the record had none there), so later launches keep it")


def keep_recorded(base: Any, held_idx: np.ndarray, record: Dict[str, Any], what: str = "data folder",
                  frames: int = 1) -> np.ndarray:
    """The held-out items of ``base`` (cut at ``frames`` frames per clip) under the recorded split:
    the items whose key ``record`` holds out at ``frames``, plus the items of ``held_idx`` (the
    rule's split of the folder as it is now) from files the record does not know (new files).
    Items of recorded files stay in training even where the rule would now hold them out. Warns
    with counts and examples when the rule's split differs (trained items it would hold out) or
    recorded held-out items are gone. A record without a split at ``frames`` (module doc) gives
    ``held_idx`` itself, with a warning when files are new or gone since the record.

    Returns sorted int64 item indices."""
    keys = item_keys(base, np.arange(len(base)))
    video = getattr(base, "item_window", None) is not None
    file_of = [k.split("#", 1)[0] if video else k for k in keys]
    known = set(record["files"])
    new, lost = len(set(file_of) - known), len(known - set(file_of))
    changed = f"({new} new file(s), {lost} gone)"
    if str(int(frames)) not in record["held_out"]:
        if new or lost:
            log.warning(f"{RECORD_NAME} holds no held-out split at {frames} frame(s) (recorded by an older vitp, or "
                        f"a bucket of that frame count was added since): the split rule splits the {what} as it is "
                        f"now, and it changed since the run started {changed}, so some of its held-out clips at "
                        f"{frames} frame(s) may have been trained on. To be sure of the held-out loss, train a new run")
        return np.sort(np.asarray(held_idx, dtype=np.int64))
    was_held = set(record["held_out"][str(int(frames))])
    now_held = np.zeros(len(keys), dtype=bool)
    now_held[np.asarray(held_idx, dtype=np.int64)] = True
    recorded = np.array([k in was_held for k in keys], dtype=bool)
    old_file = np.array([f in known for f in file_of], dtype=bool)
    trained = now_held & old_file & ~recorded  # the rule would hold out what the run trained on
    held = recorded | (now_held & ~old_file)
    gone = sorted(was_held - set(keys))
    if trained.any() or gone:
        ex = [keys[i] for i in np.flatnonzero(trained)[:3]]
        why = (f"the {what} changed since the run started {changed}" if new or lost else
               f"the split rule now splits the {what} otherwise than at the run's start, though no file is new or "
               f"gone (data.holdout_fraction, data.seed or a clip setting differs from the first launch's)")
        log.warning(
            f"{why}: the held-out split recorded in {RECORD_NAME} is kept"
            + (f"; {int(trained.sum())} item(s) the run trained on stay in training, where a new split would hold "
               f"them out (e.g. {', '.join(ex)})" if trained.any() else "")
            + (f"; {len(gone)} recorded held-out item(s) are gone (e.g. {', '.join(gone[:3])}): the held-out loss "
               f"is over {int(held.sum())} item(s) now, {len(was_held)} at the start" if gone else "")
            + ". To split the data afresh, train a new run")
    return np.flatnonzero(held).astype(np.int64)
