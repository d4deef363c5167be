"""The on-disk store of precomputed caption embeddings (format ``vitp-text-embeddings``, version 1).

Every caption is encoded once (PixArt-alpha's ``tools/extract_features.py``, Open-Sora's cached
text features, NeMo's and FastVideo's preprocessing do the same); training reads the stored
per-token embeddings and masks instead of running the text encoder. Layout of a store ``OUT/``::

    OUT/index.json                 written last (atomically): the store is complete when it exists
        {"format": "vitp-text-embeddings", "version": 1,
         "encoder": {"name", "path", "model_type", "class", "config_sha256", "hidden_size"},
         "dtype": "bfloat16" | "float32", "max_length": L, "num_captions": n, "null_id": 0,
         "shard_size": k, "captions_sha256": "<hex>", "num_truncated": t,
         "shards": [{"file": "shard-00000.safetensors", "first": 0, "count": k, "bytes": size,
                     "truncated": t0}, ...]}
    OUT/captions.jsonl             one {"id": i, "caption": "..."} per line, in id order
    OUT/shard-00000.safetensors    "embeddings" (count, L, Dc) in dtype, "mask" (count, L) bool
                                   (True: a real token); metadata format, version, first, count,
                                   config_sha256, captions_sha256, truncated (strings)
    OUT/index.partial.json         only while an encode is unfinished: the settings it resumes with

Ids: id 0 is the empty caption ``""``, the null condition of classifier-free guidance (its encoding,
as SD3 and Flux use); ids 1.. are the unique input captions in first-seen order. Shard ``s``
holds ids ``[s * k, s * k + count)``. ``encoder`` is :func:`vitp.text.encoder.encoder_record`;
``captions_sha256`` is the SHA-256 of the JSON list of the captions in id order
(:func:`captions_sha256`). ``num_truncated`` counts captions longer than ``L`` tokens.

A reader (:class:`TextEmbeddings`) refuses another ``format`` or a ``version`` other than
:data:`VERSION`; a change to the layout increments :data:`VERSION`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from vitp.utils import atomic_write, atomic_write_text, save_safetensors

log = logging.getLogger(__name__)

FORMAT = "vitp-text-embeddings"
VERSION = 1
INDEX, PARTIAL, CAPTIONS = "index.json", "index.partial.json", "captions.jsonl"
# lookups without reading every caption (written with captions.jsonl; stores made without them are read whole):
# byte offsets of its lines; the captions' 64-bit hashes, sorted, and the id of each
OFFSETS, HASHES, HASH_IDS = "captions.idx.npy", "captions.hash.npy", "captions.hash_ids.npy"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
# what must match to resume an encode or to reuse a finished store
SETTINGS = ("captions_sha256", "config_sha256", "dtype", "max_length", "shard_size")
EXPECT_KEYS = ("config_sha256", "hidden_size", "name", "weights_fingerprint")


def unique_captions(captions: Sequence[str]) -> List[str]:
    """``["", *unique non-empty captions in first-seen order]``: the captions of ids 0, 1, ...

    Raises ``TypeError`` for a caption that is not a string."""
    for c in captions:
        if not isinstance(c, str):
            raise TypeError(f"captions must be strings; got {type(c).__name__} {c!r}")
    return ["", *dict.fromkeys(c for c in captions if c != "")]


def captions_sha256(unique: Sequence[str]) -> str:
    """SHA-256 (hex) of the UTF-8 JSON list of ``unique`` (the captions in id order)."""
    return hashlib.sha256(json.dumps(list(unique), ensure_ascii=False).encode()).hexdigest()


def shard_name(s: int) -> str:
    """File name of shard ``s``: ``shard-00000.safetensors``."""
    return f"shard-{s:05d}.safetensors"


def _settings(head: Dict[str, Any]) -> Dict[str, Any]:
    return {k: head["encoder"]["config_sha256"] if k == "config_sha256" else head.get(k) for k in SETTINGS}


def describe_encoder(enc: Dict[str, Any]) -> str:
    """``name (hidden_size channels, config <sha prefix>)`` of an encoder record (or part of one;
    without a name, the part in parentheses alone)."""
    parts = [f"{enc['hidden_size']} channels"] if "hidden_size" in enc else []
    parts += [f"config {enc['config_sha256'][:12]}"] if "config_sha256" in enc else []
    if "name" not in enc:
        return ", ".join(parts) or "?"
    return f"{enc['name']} ({', '.join(parts)})" if parts else str(enc["name"])


def _difference(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    """What differs between the settings of two store headers ("" when nothing)."""
    a, b = _settings(old), _settings(new)
    out = []
    if a["captions_sha256"] != b["captions_sha256"]:
        out.append(f"embeddings of another caption list ({old.get('num_captions')} captions stored, "
                   f"{new['num_captions']} given, counting the empty caption)")
    if a["config_sha256"] != b["config_sha256"]:
        out.append(f"embeddings made by encoder {describe_encoder(old['encoder'])}, not by "
                   f"{describe_encoder(new['encoder'])}")
    out += [f"{k} {a[k]}, not {b[k]}" for k in ("dtype", "max_length", "shard_size") if a[k] != b[k]]
    return "; ".join(out)


def check_shard(path: Path, first: int, count: int, head: Dict[str, Any],
                size: Optional[int] = None) -> Optional[str]:
    """Why the shard file ``path`` is not the complete shard of ids ``[first, first + count)`` of
    the store described by ``head`` (an index), or ``None`` when it is: missing, a size other than
    ``size`` (bytes, when given), an unreadable safetensors header, other metadata (ids, encoder,
    captions), or other tensor shapes or dtype."""
    from safetensors import safe_open

    if not path.is_file():
        return "is missing"
    if size is not None and path.stat().st_size != size:
        return f"is {path.stat().st_size} bytes, the index records {size} (truncated or replaced)"
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        return f"cannot be read as safetensors ({' '.join(str(e).split())})"
    want = {"first": str(first), "count": str(count), "config_sha256": head["encoder"]["config_sha256"],
            "captions_sha256": head["captions_sha256"]}
    bad = [k for k, v in want.items() if meta.get(k) != v]
    if bad:
        return f"was written for other {', '.join(bad)} ({', '.join(f'{k}={meta.get(k)}' for k in bad)})"
    L, D = head["max_length"], head["encoder"]["hidden_size"]
    expect = {"embeddings": ([count, L, D], _SAFETENSORS_DTYPES[head["dtype"]]), "mask": ([count, L], "BOOL")}
    if shapes != expect:
        return f"holds {shapes}, expected {expect}"
    return None


def read_index(path: Path) -> Dict[str, Any]:
    """The ``index.json`` of the store folder ``path``, its format and version checked.

    Raises ``FileNotFoundError`` when there is none (saying how to make it, and that an interrupted
    encode can be finished when ``index.partial.json`` exists), ``ValueError`` for unreadable JSON,
    another format or version."""
    path = Path(path)
    file = path / INDEX
    if not file.is_file():
        msg = f"{file} not found: run vitp-encode-captions --encoder ENCODER --out {path} first"
        if not path.exists():
            msg += " (if the store moved, point data.text_embeddings at its new folder)"
        if (path / PARTIAL).is_file():
            msg += (f"; {path / PARTIAL} shows an interrupted encode: re-run the same vitp-encode-captions "
                    f"command to finish it")
        raise FileNotFoundError(msg)
    try:
        index = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); re-run vitp-encode-captions with --overwrite") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{file}: format {got!r} is not {FORMAT!r}: this folder is not a vitp text-embedding "
                         f"store; make one with vitp-encode-captions")
    if index.get("version") != VERSION:
        raise ValueError(f"{file}: version {index.get('version')!r}, this vitp reads version {VERSION}; re-encode "
                         f"the captions with this vitp (vitp-encode-captions --overwrite)")
    return index


def check_encoder(found: Dict[str, Any], expect: Dict[str, Any], where: Any, label: Optional[str] = None,
                  fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` (naming both encoders) when the encoder record ``found`` of the store
    ``where`` differs from ``expect`` in any of its keys :data:`EXPECT_KEYS`; ``ValueError`` too
    for a key of ``expect`` outside them. ``label`` names where ``expect`` came from (e.g.
    ``data.text_encoder=PATH``), ``fix`` replaces the default advice of the message."""
    unknown = sorted(set(expect) - set(EXPECT_KEYS))
    if unknown:
        raise ValueError(f"expect={expect}: unknown keys {unknown}; use {', '.join(EXPECT_KEYS)}")
    bad = [k for k in EXPECT_KEYS if k in expect and found.get(k) != expect[k]]
    if bad:
        run = f"{label} ({describe_encoder(expect)})" if label else f"the run's encoder {describe_encoder(expect)}"
        fix = fix or ("encode the captions with the run's encoder (vitp-encode-captions --encoder ...) or point the "
                      "run at a store made by it")
        raise ValueError(f"{where}: embeddings made by encoder {describe_encoder(found)}, not by {run}: they differ "
                         f"in {', '.join(bad)}; {fix}")


# ----------------------------------------------------------------------------------------- writing
def _header(encoder: Any, unique: List[str], shard_size: int, dtype: str) -> Dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "encoder": dict(encoder.record), "dtype": dtype,
            "max_length": int(encoder.max_length), "num_captions": len(unique), "null_id": 0,
            "shard_size": int(shard_size), "captions_sha256": captions_sha256(unique)}


def _existing(out: Path) -> Optional[Dict[str, Any]]:
    """The index of a finished store in ``out``, else the header of an unfinished one, else None."""
    for name in (INDEX, PARTIAL):
        if (out / name).is_file():
            try:
                head = json.loads((out / name).read_text())
                _settings(head)
                return head
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{out / name} is damaged or not a vitp text-embedding store; pick another "
                                 f"output folder or replace it (vitp-encode-captions --overwrite)") from None
    return None


def _temporary_files(out: Path) -> List[Path]:
    """Temporary files of the store's writes (:func:`vitp.utils.atomic_write` names) in ``out``."""
    return [*out.glob(".shard-*.tmp.safetensors"), *out.glob(".index*.tmp.json"), *out.glob(".captions.*.tmp.jsonl"),
            *out.glob(".captions.*.tmp.npy")]


def _remove_store(out: Path) -> None:
    """Delete the files a store consists of (and temporary files of an interrupted write), nothing else."""
    for p in [*(out / n for n in (INDEX, PARTIAL, CAPTIONS, OFFSETS, HASHES, HASH_IDS)), *out.glob("shard-*.safetensors"),
              *_temporary_files(out)]:
        p.unlink(missing_ok=True)


def caption_hash(caption: str) -> int:
    """The 64-bit hash of ``caption`` the store's lookup index sorts by (BLAKE2b of its UTF-8)."""
    return int.from_bytes(hashlib.blake2b(caption.encode("utf-8"), digest_size=8).digest(), "little")


def _write_captions(out: Path, unique: List[str]) -> None:
    with atomic_write(out / CAPTIONS) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, c in enumerate(unique):
                f.write(json.dumps({"id": i, "caption": c}, ensure_ascii=False) + "\n")
    _write_lookup(out, unique)


def _write_lookup(out: Path, unique: Sequence[str]) -> None:
    """:data:`OFFSETS`, :data:`HASHES` and :data:`HASH_IDS` of the captions ``unique`` (in id order)
    of the store ``out``: a reader finds a caption's id by binary search and reads one line."""
    from vitp.utils import write_line_offsets

    write_line_offsets(out / CAPTIONS, out / OFFSETS)
    hashes = np.fromiter((caption_hash(c) for c in unique), dtype=np.uint64, count=len(unique))
    order = np.argsort(hashes, kind="stable")
    for name, arr in ((HASHES, hashes[order]), (HASH_IDS, order.astype(np.int64))):
        with atomic_write(out / name) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, arr)


def _encode_shard(out: Path, s: int, first: int, captions: List[str], encoder: Any, head: Dict[str, Any],
                  batch_size: int, bar: Any) -> Dict[str, Any]:
    """Encode ``captions`` (ids ``first..``) in batches into shard ``s``, written atomically; its index entry."""
    n, L, D = len(captions), head["max_length"], head["encoder"]["hidden_size"]
    # filled in place: the host holds one shard (n * L * D values) in the stored dtype, not two
    tensors = {"embeddings": torch.empty(n, L, D, dtype=STORE_DTYPES[head["dtype"]]),
               "mask": torch.empty(n, L, dtype=torch.bool)}
    truncated = 0
    for i in range(0, n, batch_size):
        emb, mask = encoder.encode(captions[i:i + batch_size])
        truncated += encoder.last_truncated
        tensors["embeddings"][i:i + len(emb)] = emb
        tensors["mask"][i:i + len(emb)] = mask
        bar.update(len(emb))
    meta = {"format": FORMAT, "version": str(VERSION), "first": str(first), "count": str(n),
            "config_sha256": head["encoder"]["config_sha256"], "captions_sha256": head["captions_sha256"],
            "truncated": str(truncated)}
    path = out / shard_name(s)
    with atomic_write(path) as tmp:
        save_safetensors(tensors, str(tmp), metadata=meta)
    return {"file": path.name, "first": first, "count": n, "bytes": path.stat().st_size, "truncated": truncated}


def _kept_shard(path: Path, first: int, count: int, head: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The index entry of an already complete shard file (made by an earlier, interrupted run), else None."""
    from safetensors import safe_open

    if check_shard(path, first, count, head) is not None:
        return None
    with safe_open(str(path), "pt") as f:
        truncated = int((f.metadata() or {}).get("truncated", 0))
    return {"file": path.name, "first": first, "count": count, "bytes": path.stat().st_size, "truncated": truncated}


def _encode_all(out: Path, unique: List[str], encoder: Any, head: Dict[str, Any], batch_size: int,
                progress: bool) -> List[Dict[str, Any]]:
    """Every shard's index entry: shards already complete in ``out`` are kept, the others encoded."""
    from vitp.progress import progress_bar

    k = head["shard_size"]
    spans = [(s, first, min(k, len(unique) - first)) for s, first in enumerate(range(0, len(unique), k))]
    entries = [_kept_shard(out / shard_name(s), first, count, head) for s, first, count in spans]
    done = sum(e["count"] for e in entries if e)
    if done:
        log.info(f"resuming {out}: {sum(e is not None for e in entries)} of {len(spans)} shards are complete "
                 f"({done} captions); encoding the rest")
    with progress_bar(len(unique), "encoding captions", "caption", initial=done, disable=not progress) as bar:
        for s, first, count in spans:
            if entries[s] is None:
                entries[s] = _encode_shard(out, s, first, unique[first:first + count], encoder, head, batch_size, bar)
    return entries


def _reusable(out: Path, index: Dict[str, Any]) -> bool:
    """Whether the finished store in ``out`` is intact (every shard checked); logs the damaged ones."""
    bad = [(e["file"], why) for e in index["shards"]
           if (why := check_shard(out / e["file"], e["first"], e["count"], index, e["bytes"])) is not None]
    for name, why in bad:
        log.warning(f"{out / name} {why}: encoding it again")
    return not bad and (out / CAPTIONS).is_file()


def write_store(out: Any, captions: Sequence[str], encoder: Any, batch_size: int = 64, shard_size: int = 4096,
                progress: bool = True, overwrite: bool = False, dtype: Optional[str] = None) -> Dict[str, Any]:
    """Encode ``captions`` with ``encoder`` (a :class:`vitp.text.encoder.TextEncoder`) into the store
    ``out`` (layout: module docstring); return its index (as written to ``index.json``).

    The captions are deduplicated and the empty caption is id 0 (:func:`unique_captions`); they are
    encoded ``batch_size`` at a time (a progress bar unless ``progress`` is False:
    :func:`vitp.progress.progress_bar`) into shards of ``shard_size`` captions, each written to a
    temporary name and renamed. ``dtype``: the stored
    dtype, ``"bfloat16"`` or ``"float32"`` (default: bfloat16 for a bfloat16 encoder, else float32).

    Resumable: ``index.partial.json`` records the settings (:data:`SETTINGS`); a rerun after a kill
    keeps the shards that are complete (checked by :func:`check_shard`) and encodes the rest;
    ``index.json`` is written last. A rerun on a finished store with the same settings encodes
    nothing (it re-encodes only shards found damaged) and logs that it is complete.

    Raises ``ValueError`` when ``out`` holds a store (finished or not) of other captions, another
    encoder, dtype, max_length or shard_size, naming the difference (``overwrite=True`` replaces
    it), when ``out`` is a file or a non-empty folder holding no store (the data folder: its
    ``captions.jsonl`` would be replaced), or for a bad ``batch_size``/``shard_size``/``dtype``."""
    out = Path(out)
    dtype = dtype or ("bfloat16" if encoder.dtype == "bfloat16" else "float32")
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: a store holds {' or '.join(STORE_DTYPES)}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size={batch_size}, shard_size={shard_size}: use positive numbers of captions")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder for the text embeddings")
    if out.is_dir() and _existing(out) is None and any(out.iterdir()):
        raise ValueError(f"{out} holds other files and no text-embedding store; give an empty or new folder for the "
                         f"store (it writes index.json, captions.jsonl and shards there): never the data folder")
    unique = unique_captions(captions)
    head = _header(encoder, unique, shard_size, dtype)
    if overwrite and out.is_dir():
        _remove_store(out)
    old = _existing(out)
    diff = _difference(old, head) if old is not None else ""
    if diff:
        raise ValueError(f"{out} holds {diff}; pick another output folder or replace it (vitp-encode-captions "
                         f"--overwrite)")
    if old is not None and "shards" in old:
        if _reusable(out, old):
            log.info(f"{out} is complete ({old['num_captions']} captions, the same captions and encoder): "
                     f"nothing to encode")
            if not all((out / n).is_file() for n in (OFFSETS, HASHES, HASH_IDS)):  # made by an older vitp
                _write_lookup(out, unique)
            return old
    out.mkdir(parents=True, exist_ok=True)
    for tmp in _temporary_files(out):  # left by a killed run (atomic_write removes its own otherwise)
        tmp.unlink(missing_ok=True)
    atomic_write_text(out / PARTIAL, json.dumps(head, indent=1))
    (out / INDEX).unlink(missing_ok=True)  # a damaged finished store: it is unfinished until rewritten
    _write_captions(out, unique)
    shards = _encode_all(out, unique, encoder, head, batch_size, progress)
    index = {**head, "num_truncated": sum(e["truncated"] for e in shards), "shards": shards}
    atomic_write_text(out / INDEX, json.dumps(index, indent=1), fsync=True)
    (out / PARTIAL).unlink(missing_ok=True)
    return index


# ----------------------------------------------------------------------------------------- reading
class TextEmbeddings:
    """Read side of a store (layout: module docstring), for training and its DataLoader workers.

    ``path``: the store folder; ``expect``: the encoder the run uses, a dict with any of
    ``config_sha256``, ``hidden_size``, ``name`` (e.g. :func:`vitp.text.encoder.encoder_record`
    minus path), checked against the store's. Attributes ``path``, ``index``, ``encoder`` (the
    record), ``dim`` (``Dc``), ``max_length`` (``L``), ``null_id`` (0, the empty caption),
    ``dtype`` (stored dtype); ``len()`` is the number of captions.

    Pickles (for DataLoader workers): shard files are opened lazily with ``safetensors.safe_open``
    in each process and the handles are not pickled; the captions are read on first use.

    Raises at open, each naming the file and the fix: ``FileNotFoundError`` for a missing
    ``index.json`` (see :func:`read_index`), ``captions.jsonl`` or shard; ``ValueError`` for another
    format or version, a truncated or unreadable shard (:func:`check_shard`), or an ``expect``
    that differs (:func:`check_encoder`).
    """

    def __init__(self, path: Any, expect: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        self.index = read_index(self.path)
        self.encoder = self.index["encoder"]
        self.dim, self.max_length = int(self.encoder["hidden_size"]), int(self.index["max_length"])
        self.null_id, self.dtype = int(self.index["null_id"]), self.index["dtype"]
        fix = f"re-run the vitp-encode-captions command that made {self.path}: it re-encodes missing or damaged shards"
        if not (self.path / CAPTIONS).is_file():
            raise FileNotFoundError(f"{self.path / CAPTIONS} is missing; {fix}")
        for e in self.index["shards"]:
            why = check_shard(self.path / e["file"], e["first"], e["count"], self.index, e["bytes"])
            if why == "is missing":
                raise FileNotFoundError(f"{self.path / e['file']} (listed in {self.path / INDEX}) is missing; {fix}")
            if why is not None:
                raise ValueError(f"{self.path / e['file']} {why}; {fix}")
        if expect:
            check_encoder(self.encoder, expect, self.path)
        self._firsts = np.array([e["first"] for e in self.index["shards"]], dtype=np.int64)
        self._handles: Dict[int, Any] = {}
        self._pid = os.getpid()
        self._captions: Optional[List[str]] = None
        self._ids: Optional[Dict[str, int]] = None
        self._lookup: Optional[Tuple[np.ndarray, ...]] = None

    def __len__(self) -> int:
        return int(self.index["num_captions"])

    def __repr__(self) -> str:
        return (f"TextEmbeddings({str(self.path)!r}: {len(self)} captions x {self.max_length} tokens x {self.dim} "
                f"channels, {self.dtype}, encoder {self.encoder['name']})")

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_handles={}, _captions=None, _ids=None, _lookup=None)  # reopened / remapped where received
        return state

    def _load_captions(self) -> List[str]:
        if self._captions is None:
            file = self.path / CAPTIONS
            try:
                rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line]
                captions = [r["caption"] for r in rows]
                ids = [r["id"] for r in rows]
            except (ValueError, KeyError, TypeError) as e:  # cut short or edited: one line naming the file
                raise ValueError(f"{file} is damaged ({type(e).__name__}: {e}); re-run vitp-encode-captions with "
                                 f"--overwrite") from None
            if ids != list(range(len(self))) or captions_sha256(captions) != self.index["captions_sha256"]:
                raise ValueError(f"{file} does not match {self.path / INDEX} (other captions or ids); re-run "
                                 f"vitp-encode-captions with --overwrite")
            self._captions = captions
        return self._captions

    def _indexed(self) -> Optional[Tuple[np.ndarray, ...]]:
        """``(line offsets, sorted hashes, their ids, captions bytes)`` memory-mapped, or None for a
        store written without them (or whose offsets do not fit its captions file: it is read whole)."""
        if self._lookup is None:
            files = [self.path / n for n in (OFFSETS, HASHES, HASH_IDS)]
            size = (self.path / CAPTIONS).stat().st_size
            if not all(f.is_file() for f in files) or not size:
                return None
            try:
                offsets, hashes, ids = (np.load(f, mmap_mode="r") for f in files)
            except (ValueError, OSError):  # damaged: the lookup falls back to reading the captions
                offsets = hashes = ids = np.zeros(0)
            if len(offsets) != len(self) + 1 or int(offsets[-1]) != size or not len(hashes) == len(ids) == len(self):
                log.warning(f"{self.path}: its caption lookup files do not match {CAPTIONS}; reading the captions "
                            f"whole (re-run vitp-encode-captions on the same data to rewrite them)")
                return None
            self._lookup = (offsets, hashes, ids, np.memmap(self.path / CAPTIONS, dtype=np.uint8, mode="r"))
        return self._lookup

    def _line(self, i: int) -> str:
        offsets, _, _, buf = self._lookup
        try:
            row = json.loads(bytes(buf[int(offsets[i]):int(offsets[i + 1])]))
            if row["id"] != i:
                raise ValueError(f"line {i + 1} holds id {row['id']}")
            return row["caption"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path / CAPTIONS} is damaged ({e}); re-run vitp-encode-captions with "
                             f"--overwrite") from None

    def find(self, caption: str) -> Optional[int]:
        """The id of ``caption``, or None: a binary search of the hashes, then the lines compared."""
        if self._indexed() is None:
            return self._id_map().get(caption)
        _, hashes, ids, _ = self._lookup
        h = np.uint64(caption_hash(caption))
        lo, hi = int(np.searchsorted(hashes, h, "left")), int(np.searchsorted(hashes, h, "right"))
        return next((int(ids[k]) for k in range(lo, hi) if self._line(int(ids[k])) == caption), None)

    def _id_map(self) -> Dict[str, int]:
        if self._ids is None:
            self._ids = {c: i for i, c in enumerate(self._load_captions())}
        return self._ids

    def __contains__(self, caption: str) -> bool:
        """Whether the store holds ``caption``."""
        return self.find(caption) is not None

    def id_of(self, caption: str) -> int:
        """The id of ``caption`` (0 for ``""``). Raises ``KeyError`` naming the caption and the store."""
        i = self.find(caption)
        if i is None:
            raise KeyError(f"caption {caption!r} is not in the text embeddings at {self.path} ({len(self)} captions); "
                           f"re-run vitp-encode-captions on this data to encode it")
        return i

    def ids_of(self, captions: Sequence[str]) -> np.ndarray:
        """The ids ``(B,)`` int64 of ``captions`` (:meth:`id_of`, same errors)."""
        return np.array([self.id_of(c) for c in captions], dtype=np.int64)

    def caption(self, i: int) -> str:
        """The caption of id ``i``. Raises ``IndexError`` outside ``[0, len)``."""
        if not 0 <= int(i) < len(self):
            raise IndexError(f"caption id {i} is outside [0, {len(self)}) of {self.path}")
        if self._indexed() is not None:
            return self._line(int(i))
        return self._load_captions()[int(i)]

    def _handle(self, s: int) -> Any:
        from safetensors import safe_open

        if self._pid != os.getpid():  # a forked worker: open its own handles
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            self._handles[s] = safe_open(str(self.path / self.index["shards"][s]["file"]), "pt")
        return self._handles[s]

    def get(self, ids: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``(B, L, Dc)`` float32 and mask ``(B, L)`` bool of the ``B`` ids (a sequence,
        array or tensor of ints), in their order. Raises ``IndexError`` for an id outside ``[0, len)``."""
        ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= len(self))]
        if bad.size:
            raise IndexError(f"caption ids {bad[:5].tolist()} are outside [0, {len(self)}) of {self.path}")
        emb = torch.empty(len(ids), self.max_length, self.dim, dtype=torch.float32)
        mask = torch.empty(len(ids), self.max_length, dtype=torch.bool)
        shards = np.searchsorted(self._firsts, ids, side="right") - 1
        for j, (i, s) in enumerate(zip(ids.tolist(), shards.tolist())):
            f, row = self._handle(s), i - int(self._firsts[s])
            emb[j] = f.get_slice("embeddings")[row:row + 1][0]
            mask[j] = f.get_slice("mask")[row:row + 1][0]
        return emb, mask
