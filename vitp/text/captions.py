"""The captions of a data set's files: sidecar ``.txt`` files or one manifest (``.jsonl`` / ``.csv``).

Sidecars are the layout of kohya-ss/sd-scripts and of many image-caption folders (``cat.jpg`` +
``cat.txt``); manifests follow the ``{"file": ..., "caption": ...}`` rows of PixArt-alpha's and
Open-Sora's data lists (Open-Sora's CSV has ``path`` and ``text`` columns, accepted here too).
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

FILE_KEYS = ("file", "path")  # manifest column / key naming the data file, relative to the root
CAPTION_KEYS = ("caption", "text")
SOURCES = "sidecar, a .jsonl manifest or a .csv manifest"


def _key(root: Path, file: Path) -> str:
    """A data file's path as one string for matching: absolute, normalised (not following links)."""
    return os.path.normpath(os.path.abspath(file if file.is_absolute() else root / file))


def _sidecars(root: Path, files: Sequence[Path]) -> List[Optional[str]]:
    out: List[Optional[str]] = []
    for f in files:
        txt = Path(_key(root, Path(f))).with_suffix(".txt")
        try:
            out.append(txt.read_text(encoding="utf-8").strip() if txt.is_file() else None)
        except UnicodeDecodeError as e:
            raise ValueError(f"{txt}: not UTF-8 text ({e})") from None
    return out


def _pick(row: Dict, keys: Tuple[str, ...], where: str, what: str) -> str:
    name = next((k for k in keys if k in row), None)
    if name is None:
        raise ValueError(f"{where}: no {what} ({' or '.join(repr(k) for k in keys)}); keys are {sorted(row)}")
    value = row[name]
    if not isinstance(value, str) or (what == "file" and not value):
        raise ValueError(f"{where}: {name} must be a non-empty string, got {value!r}" if what == "file"
                         else f"{where}: {name} must be a string, got {value!r}")
    return value


def _jsonl_rows(path: Path) -> Iterator[Tuple[str, str, str]]:
    """``(where, file, caption)`` per non-blank line of a JSON-lines manifest."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with file and caption, got {type(row).__name__}")
            yield where, _pick(row, FILE_KEYS, where, "file"), _pick(row, CAPTION_KEYS, where, "caption")


def _csv_rows(path: Path) -> Iterator[Tuple[str, str, str]]:
    """``(where, file, caption)`` per row of a CSV manifest with a header line."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for keys, what in ((FILE_KEYS, "file"), (CAPTION_KEYS, "caption")):
            if not any(k in header for k in keys):
                raise ValueError(f"{path}:1: the header has no {what} column ({' or '.join(keys)}); it has {header}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            clean = {k: v for k, v in row.items() if k is not None and v is not None}
            yield where, _pick(clean, FILE_KEYS, where, "file"), _pick(clean, CAPTION_KEYS, where, "caption")


def manifest_path(root: Path, source: str) -> Path:
    """The manifest named by ``source`` (absolute, or relative to ``root``).

    Raises ``ValueError`` for an extension other than ``.jsonl`` / ``.csv``, ``FileNotFoundError``
    when the file does not exist."""
    if Path(source).suffix.lower() not in (".jsonl", ".csv"):
        raise ValueError(f"captions source {source!r}: use {SOURCES}")
    path = Path(source).expanduser()
    path = path if path.is_absolute() else Path(root) / path
    if not path.is_file():
        raise FileNotFoundError(f"caption manifest {path} not found (data.captions={source}; a relative path is read "
                                f"from the data root {root}): write it, one {{\"file\": ..., \"caption\": ...}} "
                                "per line (.jsonl) or a header with file and caption columns (.csv), or give its path")
    return path


def read_captions(root: Path, files: Sequence[Path], source: str) -> Tuple[List[Optional[str]], Dict[str, int]]:
    """The caption of each of ``files`` (paths absolute or relative to ``root``), ``None`` for a file
    without one, and counts ``{"missing": files without a caption, "unused_entries": manifest rows
    naming no file of files, "duplicate_entries": further rows for a file already captioned (the first wins)}``.

    ``source``: ``"sidecar"``, the stripped text of ``<file without suffix>.txt`` next to each file (an
    empty file is the caption ``""``); or a manifest path (:func:`manifest_path`): ``.jsonl`` with one
    object per line, keys ``file`` (or ``path``, relative to ``root``) and ``caption`` (or ``text``), or
    ``.csv`` with a header naming those columns. Manifest captions are stripped too.

    Raises ``FileNotFoundError`` for a missing manifest; ``ValueError`` for an unsupported
    ``source``, a malformed JSON line, a missing column or key (``file:line``), or non-UTF-8 text."""
    root = Path(root)
    if source == "sidecar":
        caps = _sidecars(root, files)
        return caps, {"missing": sum(c is None for c in caps), "unused_entries": 0, "duplicate_entries": 0}
    path = manifest_path(root, source)
    wanted = {_key(root, Path(f)): i for i, f in enumerate(files)}
    caps: List[Optional[str]] = [None] * len(files)
    unused = duplicate = 0
    try:
        rows = list((_jsonl_rows if path.suffix.lower() == ".jsonl" else _csv_rows)(path))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    for _, file, caption in rows:
        i = wanted.get(_key(root, Path(file)))
        if i is None:
            unused += 1
        elif caps[i] is not None:
            duplicate += 1
        else:
            caps[i] = caption.strip()
    return caps, {"missing": sum(c is None for c in caps), "unused_entries": unused, "duplicate_entries": duplicate}
