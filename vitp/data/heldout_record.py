"""The held-out split a run started with, recorded in its folder and kept when it resumes.

A folder's split (:meth:`vitp.data.video.VideoFolderDataset.heldout_items`,
:func:`vitp.data.base.stratified_split`) is a function of the files found: a file added or
deleted between two launches can move a clip the run trained on into the held-out set, whose
loss would then score training data. ``vitp-train`` writes :data:`RECORD_NAME` into the run
folder when it first trains (the files it found and the keys of its held-out items) and every
later launch keeps that split: recorded held-out items stay held out, items of recorded files stay
in training, and only new files are split by the rule. What changed is logged as a warning.

An item's key is its file (relative to ``data.root`` when under it) and, for a video, ``#<window>``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from vitp.utils import atomic_write_text

log = logging.getLogger(__name__)

RECORD_NAME = "heldout_split.json"
_VERSION = 1


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


def split_record(base: Any, held_idx: Sequence[int]) -> Dict[str, Any]:
    """What :func:`write_record` stores: ``{"version", "files": every usable file's key, "held_out":
    the keys of the items held_idx}`` (keys as in :func:`item_keys`)."""
    root = getattr(base, "root", None)
    return {"version": _VERSION, "files": sorted(_file_key(p, root) for p in base.files),
            "held_out": sorted(item_keys(base, held_idx))}


def write_record(path: Path, base: Any, held_idx: Sequence[int]) -> None:
    """Write :func:`split_record` to ``path`` (atomically; once per run, at its first launch)."""
    atomic_write_text(Path(path), json.dumps(split_record(base, held_idx)))


def read_record(path: Optional[Path]) -> Optional[Dict[str, Any]]:
    """The record at ``path``; ``None`` when ``path`` is None or absent.

    Raises ``ValueError`` naming the file when it is not a record this version wrote."""
    if path is None or not Path(path).is_file():
        return None
    try:
        rec = json.loads(Path(path).read_text())
        if rec.get("version") == _VERSION and isinstance(rec["files"], list) and isinstance(rec["held_out"], list):
            return rec
    except (ValueError, KeyError, AttributeError):
        pass
    raise ValueError(f"{path} is not a held-out split record vitp wrote (damaged?); restore it from a copy of the run, "
                     f"or delete it to split the data again (the held-out loss may then score clips the run trained on)")


def keep_recorded(base: Any, held_idx: np.ndarray, record: Dict[str, Any], what: str = "data folder") -> np.ndarray:
    """The held-out items of ``base`` under the recorded split: the items whose key ``record``
    holds out, plus the items of ``held_idx`` (the rule's split of the folder as it is now) from
    files the record does not know (new files). Items of recorded files stay in training even
    where the rule would now hold them out. Warns with counts and examples when the rule's split
    differs (trained items it would hold out) or recorded held-out items are gone.

    Returns sorted int64 item indices."""
    keys = item_keys(base, np.arange(len(base)))
    was_held, known = set(record["held_out"]), set(record["files"])
    file_of = [k.split("#", 1)[0] if getattr(base, "item_window", None) is not None else k for k in keys]
    now_held = np.zeros(len(keys), dtype=bool)
    now_held[np.asarray(held_idx, dtype=np.int64)] = True
    recorded = np.array([k in was_held for k in keys], dtype=bool)
    old_file = np.array([f in known for f in file_of], dtype=bool)
    trained = now_held & old_file & ~recorded  # the rule would hold out what the run trained on
    held = recorded | (now_held & ~old_file)
    gone = sorted(was_held - set(keys))
    if trained.any() or gone:
        ex = [keys[i] for i in np.flatnonzero(trained)[:3]]
        log.warning(
            f"the {what} changed since the run started ({len(set(file_of) - known)} new file(s), "
            f"{len(known - set(file_of))} gone): the held-out split recorded in {RECORD_NAME} is kept"
            + (f"; {int(trained.sum())} item(s) the run trained on stay in training, where a new split would hold "
               f"them out (e.g. {', '.join(ex)})" if trained.any() else "")
            + (f"; {len(gone)} recorded held-out item(s) are gone (e.g. {', '.join(gone[:3])}): the held-out loss "
               f"is over {int(held.sum())} item(s) now, {len(was_held)} at the start" if gone else "")
            + ". To split the changed data afresh, train a new run")
    return np.flatnonzero(held).astype(np.int64)
