"""Sharded data sets: WebDataset tar shards written by ``vitp-pack``, read by random access.

Layout of a packed data set (a local folder or an object-store prefix, ``data.shards``):

- ``shard-000000.tar`` ...: WebDataset tar shards (https://github.com/webdataset/webdataset). Sample
  ``i`` is the files ``{i:09d}.<ext>``: the source file's bytes as they were (``jpg``, ``png``,
  ``mp4``, ...; the digits' 8x8 pixels as ``npy``), ``cls`` (the label), ``txt`` (the caption, if
  any) and ``json`` (source file, class name);
- ``index.json``: the shard list in wids's descriptor format (``wids_version``, ``shardlist`` of
  ``{"url", "nsamples", "filesize"}``), plus a ``vitp`` section: kind, classes, counts, the
  skipped files and why, the held-out split's definition, the source config;
- ``samples.safetensors``: per-sample arrays read at start-up instead of opening shards: ``label``,
  ``heldout`` (the held-out split), ``height``/``width`` (pixels as displayed: bucket assignment),
  ``frames``/``fps`` (video: clip windows), ``heldout_from`` (video: the first held-out frame;
  0 = the whole file, ``frames`` = none), ``orientation`` (video: 0, or k for the manifest's
  ``orientations[k - 1]``), ``captioned`` (with captions: 1 where the sample has one; packs
  written before it are scanned for ``null`` lines instead);
- ``captions.jsonl`` (one caption per sample: a JSON string or ``null``), ``captions.idx.npy``
  (int64 byte offsets of its lines, memory-mapped: a caption is read and parsed when its item asks;
  packs without it are scanned once per process) and ``text-embeddings/`` (the caption store of
  :mod:`vitp.text.store`) when the data set has captions.

Samples are read with ``wids`` (``wids.ShardListDataset``, webdataset's random-access reader): it
indexes each shard's tar headers when first opened (memory-mapped; no extraction) and keeps the
last ``lru`` shards open; remote shards are downloaded whole into a cache folder first (wids's
per-scheme download handlers; ``s3://`` through ``boto3`` here, which honours ``AWS_ENDPOINT_URL``).
Start-up reads the two small files above, never the shards: its time does not grow with the
number of samples beyond loading ``samples.safetensors`` (about 30 bytes per sample).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

import numpy as np
import torch

from vitp.data.base import FileDataset, ItemArray, KeyedDataset, KeyedSubset, Picked, StorageError, parse_key, wrapped
from vitp.remote import REMOTE_SCHEMES, _s3_client, _split_s3, is_remote, join_url, read_bytes  # noqa: F401 - re-exported
from vitp.data.images import digits_tensor, load_image
from vitp.data.video import VideoFolderDataset
from vitp.utils import atomic_write, line_offsets, write_line_offsets

log = logging.getLogger(__name__)

FORMAT, VERSION = "vitp-shards", 1
MANIFEST, SAMPLES, CAPTIONS, TEXT_STORE = "index.json", "samples.safetensors", "captions.jsonl", "text-embeddings"
CAPTION_OFFSETS = "captions.idx.npy"  # int64 (n + 1,): where each line of captions.jsonl starts, then its size
_ARRAYS = ("label", "heldout", "heldout_from", "height", "width", "frames", "fps", "orientation")  # samples.safetensors
_CHUNK = 1 << 13  # samples / items per chunk of the start-up arithmetic: its int64 temporaries stay under
# glibc's 128 KiB mmap threshold, so freeing them never raises it (heap pages reused)
META_EXTS = ("cls", "txt", "json")  # a sample's files other than its media
_LOGGED: set = set()  # shard_datasets' summary lines already logged
# the fix a damaged pack file's message names: vitp-pack repairs a damaged pack of the same config (vitp.data.pack)
REPACK = "re-run the same vitp-pack command (it repairs the pack)"
# a shard of the right size whose content is damaged is not found by vitp-pack's check: deleted, it is written again
REPACK_SHARD = "delete it and re-run the same vitp-pack command (it writes missing shards again)"


def s3_download(remote: str, local: str) -> None:
    """wids download handler for ``s3://``: ``boto3`` into ``local`` (:meth:`ShardReader.local_path`
    passes a ``.part`` file, renamed when complete and removed on failure).

    Raises :class:`~vitp.data.base.StorageError` naming the shard: the dataset raises it through
    instead of skipping the shard's samples (a run stops and resumes from its last checkpoint)."""
    bucket, key = _split_s3(remote)
    try:
        _s3_client().download_file(bucket, key, local)
    except Exception as e:  # noqa: BLE001 - botocore / network errors carry the reason
        raise StorageError(f"shard {remote} could not be downloaded ({type(e).__name__}: {e}); check that the "
                           f"object exists (vitp-pack's output complete under data.shards), the endpoint "
                           f"(AWS_ENDPOINT_URL) and the credentials, then resume the run") from e


def _use_handlers() -> None:
    import wids.wids_dl

    wids.wids_dl.default_cmds["s3"] = s3_download  # the module's handler table (its own uses the aws CLI)


@functools.lru_cache(maxsize=4)
def _per_sample(url: str, captions: bool, manifest_sha1: str) -> Tuple[Dict[str, np.ndarray], Optional["CaptionLines"]]:
    """``samples.safetensors`` and the :class:`CaptionLines` of ``captions.jsonl`` of the pack at
    ``url``, read once per process and manifest (the data sets of each shape bucket open the same
    pack; remote: one download). A local file is memory-mapped: start-up touches only the arrays it
    uses, and the ranks of a node share their pages."""
    where = join_url(url, SAMPLES)
    try:
        arrays = _load_samples(where)
        missing = [k for k in _ARRAYS if k not in arrays]
    except FileNotFoundError:
        raise FileNotFoundError(f"{where} is missing; {REPACK}, or copy {SAMPLES} again "
                                f"from where the pack was copied") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ValueError(f"{where} is damaged ({type(e).__name__}: {e}); {REPACK}, "
                         f"or copy {SAMPLES} again from where the pack was copied") from None
    if missing:
        raise ValueError(f"{where} lacks the arrays {', '.join(missing)}; {REPACK}")
    return arrays, (CaptionLines(url, arrays.get("captioned")) if captions else None)


_ST_DTYPES = {"U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F32": np.float32,
              "F64": np.float64, "BOOL": np.bool_}


def _load_samples(where: str) -> Dict[str, np.ndarray]:
    """The arrays of the safetensors file ``where``: a remote one downloaded and loaded
    (``safetensors.numpy.load``); a local one memory-mapped read-only at the offsets of its header
    (safetensors' numpy API copies every array), after ``safetensors.safe_open`` has checked it."""
    from safetensors import safe_open
    from safetensors.numpy import load

    if is_remote(where):
        return load(read_bytes(where))
    with safe_open(where, framework="np") as f:  # parses and checks the header against the size
        names = list(f.keys())
    with open(where, "rb") as fh:
        start = 8 + int.from_bytes(fh.read(8), "little")
        fh.seek(8)
        header = json.loads(fh.read(start - 8))
    out = {}
    for name in names:
        spec = header[name]
        dtype, (b, e), shape = np.dtype(_ST_DTYPES[spec["dtype"]]), spec["data_offsets"], tuple(spec["shape"])
        out[name] = (np.memmap(where, dtype=dtype, mode="r", offset=start + b, shape=shape) if e > b
                     else np.zeros(shape, dtype=dtype))
    return out


def write_caption_offsets(jsonl: Union[str, Path]) -> Path:
    """Write :data:`CAPTION_OFFSETS` next to the captions file ``jsonl`` (what ``vitp-pack`` does);
    returns its path."""
    return write_line_offsets(jsonl, Path(jsonl).parent / CAPTION_OFFSETS)


class CaptionLines(Sequence):
    """The captions of a pack, ``captions[i]`` (str or None) parsed from line ``i`` of its
    ``captions.jsonl`` when asked: the file is memory-mapped (remote: held as bytes), the line
    offsets memory-mapped from :data:`CAPTION_OFFSETS` or, for packs written without it, found by
    one scan. ``present`` is a bool array: which samples have a caption (``samples.safetensors``'s
    ``captioned`` where the pack has it, else found in the file without parsing).

    Raises ``ValueError`` naming the file and the fix when it is cut short or does not parse
    (at start-up: a missing final newline or another line count than samples; on access: a line
    that is not a JSON string or null)."""

    def __init__(self, url: str, captioned: Optional[np.ndarray] = None):
        self.url, self.where = url, join_url(url, CAPTIONS)
        self._buf = None
        if captioned is not None:  # written by vitp-pack: the file's pages stay untouched at start-up
            self.present = captioned.view(bool) if captioned.dtype == np.uint8 else captioned.astype(bool)
        buf = self._bytes()
        offsets = None
        if not is_remote(url) and os.path.isfile(join_url(url, CAPTION_OFFSETS)):
            offsets = np.load(join_url(url, CAPTION_OFFSETS), mmap_mode="r")
            if len(offsets) < 1 or offsets[-1] != len(buf):
                offsets = None  # written for another captions file: scan this one
        self.offsets = line_offsets(buf) if offsets is None else offsets
        if len(buf) and buf[-1] != ord("\n"):
            raise self._damaged(f"it ends inside line {len(self)} (cut short)")

    def _bytes(self) -> np.ndarray:
        if self._buf is None:
            if is_remote(self.url):
                self._buf = np.frombuffer(read_bytes(self.where), dtype=np.uint8)
            elif os.path.getsize(self.where):
                self._buf = np.memmap(self.where, dtype=np.uint8, mode="r")
            else:
                self._buf = np.zeros(0, np.uint8)
        return self._buf

    def _damaged(self, why: str) -> ValueError:
        return ValueError(f"{self.where} is damaged: {why}; {REPACK}, or copy {CAPTIONS} "
                          f"again from where the pack was copied")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Optional[str]:
        i = int(i)
        line = bytes(self._bytes()[int(self.offsets[i]):int(self.offsets[i + 1])])
        try:
            caption = json.loads(line)
        except ValueError as e:
            raise self._damaged(f"line {i + 1} is not JSON ({e})") from None
        if caption is not None and not isinstance(caption, str):
            raise self._damaged(f"line {i + 1} holds a {type(caption).__name__}, not a caption")
        return caption

    @functools.cached_property
    def present(self) -> np.ndarray:
        """bool ``(len,)``: whether sample ``i`` has a caption (its line is not ``null``)."""
        buf, out = self._bytes(), np.ones(len(self), dtype=bool)
        for a in range(0, len(self), 1 << 20):  # chunks: a few bytes per line of temporaries
            start = np.asarray(self.offsets[a:a + (1 << 20) + 1], dtype=np.int64)
            short = np.flatnonzero(np.diff(start) == 5)  # "null\n"
            head = buf[start[short][:, None] + np.arange(4)] if len(short) else np.zeros((0, 4), np.uint8)
            out[a + short[(head == np.frombuffer(b"null", np.uint8)).all(axis=1)]] = False
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__, _buf=None)  # DataLoader workers map the files again
        if isinstance(self.offsets, np.memmap):
            state["offsets"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.offsets is None:
            self.offsets = np.load(join_url(self.url, CAPTION_OFFSETS), mmap_mode="r")


class ShardIndex:
    """The manifest and per-sample arrays of a packed data set (read at start-up, no shard opened).

    Attributes: ``url`` (the folder / prefix), ``shards`` (wids shard list with absolute URLs),
    ``meta`` (the manifest's ``vitp`` section), ``kind`` (``"image"``, ``"digits"``, ``"video"``),
    ``classes``, the arrays ``label``, ``heldout``, ``heldout_from``, ``height``, ``width``, ``frames``, ``fps``,
    ``orientation`` (one entry per sample), ``shard_of`` (shard number of each sample), ``captions``
    (:class:`CaptionLines` or None).

    Raises
    ------
    FileNotFoundError
        No manifest at ``url`` (names the URL and ``vitp-pack``), or a shard missing or of another
        size than packed (local folders and ``s3://``: names the shard).
    ValueError
        A manifest of another format or version, or arrays that disagree with the shard list; a
        damaged ``index.json``, ``samples.safetensors`` or ``captions.jsonl`` (one line naming the
        file and the fix: re-run the same ``vitp-pack`` command, which repairs the pack).
    """

    def __init__(self, url: str, check: bool = True):
        self.url = str(url).rstrip("/") if is_remote(url) else str(Path(url).expanduser().resolve())
        where = join_url(self.url, MANIFEST)
        try:
            raw = read_bytes(where)
            spec = json.loads(raw)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no packed data set at data.shards={url} ({e}); write one with "
                                    f"vitp-pack OUT <data overrides> and set data.shards=OUT") from None
        except ValueError as e:
            raise ValueError(f"{where} is not a JSON manifest ({e}): it is damaged; {REPACK}") from None
        except StorageError as e:
            raise StorageError(f"data.shards={url}: {e}") from None
        meta = spec.get("vitp", {}) if isinstance(spec, dict) else {}
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{where} is not a {FORMAT} v{VERSION} manifest (format={meta.get('format')!r}, "
                             f"version={meta.get('version')!r}); pack the data with this vitp's vitp-pack")
        try:
            self.meta, self.kind, self.classes = meta, meta["kind"], list(meta["classes"])
            self.shards = [dict(s, url=join_url(self.url, s["url"])) for s in spec["shardlist"]]
            n = sum(int(s["nsamples"]) for s in self.shards)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} is damaged (no usable {e} entry); {REPACK}") from None
        self.manifest_sha1 = hashlib.sha1(raw).hexdigest()
        arrays, self.captions = _per_sample(self.url, bool(meta.get("captions")), self.manifest_sha1)
        for k in _ARRAYS:
            if len(arrays[k]) != n:
                raise ValueError(f"{join_url(self.url, SAMPLES)}: {k} has {len(arrays[k])} entries but the shards "
                                 f"hold {n} samples; {REPACK}")
            setattr(self, k, arrays[k])
        if self.captions is not None and len(self.captions.present) != n:
            raise ValueError(f"{join_url(self.url, SAMPLES)}: captioned has {len(self.captions.present)} entries but "
                             f"the shards hold {n} samples; {REPACK}")
        if self.captions is not None and len(self.captions) != n:
            raise self.captions._damaged(f"it has {len(self.captions)} lines but the shards hold {n} samples")
        self._starts = np.cumsum([0] + [int(s["nsamples"]) for s in self.shards], dtype=np.int64)
        self.shard_of = ItemArray(self._shards_at, n, np.int32)  # by search: nothing stored per sample
        if check:
            self.check_shards()

    def __len__(self) -> int:
        return len(self.label)

    def _shards_at(self, samples: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._starts, samples, side="right") - 1

    def orientation_of(self, i: int) -> Optional[str]:
        """How players turn sample ``i``'s frames upright (:func:`vitp.media.video.display_orientation`)."""
        k = int(self.orientation[i])
        return None if k == 0 else self.meta["orientations"][k - 1]

    @property
    def text_store(self) -> Optional[str]:
        """The packed caption store (a local folder) or None."""
        name = self.meta.get("text_embeddings")
        return None if name is None or is_remote(self.url) else join_url(self.url, name)

    def check_shards(self) -> None:
        """Every shard present with the size it was packed with: a ``stat`` per shard for a local
        folder, one listing per 1000 shards for ``s3://`` (other URLs are checked when read).
        Raises ``FileNotFoundError`` naming the missing / truncated shards."""
        sizes = self._listed_sizes()
        if sizes is None:
            return
        bad = []
        for s in self.shards:
            got = sizes.get(s["url"])
            if got is None:
                bad.append(f"{s['url']} is missing")
            elif "filesize" in s and got != s["filesize"]:
                bad.append(f"{s['url']} has {got} bytes, packed with {s['filesize']} (truncated or replaced)")
        if bad:
            raise FileNotFoundError(f"{len(bad)} of the {len(self.shards)} shards of data.shards={self.url} are "
                                    f"unusable: {'; '.join(bad[:5])}; copy the shards again or {REPACK}")

    def _listed_sizes(self) -> Optional[Dict[str, int]]:
        scheme = urlparse(self.url).scheme
        if scheme == "s3":
            bucket, prefix = _split_s3(self.url + "/")
            pages = _s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            return {f"s3://{bucket}/{o['Key']}": o["Size"] for p in pages for o in p.get("Contents", [])}
        if is_remote(self.url):
            return None
        return {s["url"]: os.stat(s["url"]).st_size for s in self.shards if os.path.isfile(s["url"])}


class ShardReader:
    """One process's random access to the samples of a :class:`ShardIndex` (``wids``).

    ``reader[i]`` is ``{ext: bytes}`` of sample ``i``. A shard is opened with
    ``wids.IndexedTarSamples`` (memory-mapped, its tar headers indexed; nothing written next to
    it, so read-only mounts work) and the last ``lru`` shards stay open. Remote shards are first
    downloaded whole into ``cache_dir`` (a folder per data set URL) with wids's per-scheme download
    handlers, through a ``.part`` file renamed when complete: concurrent readers and killed
    downloads never leave a truncated shard in the cache. Downloaded shards are kept (the cache
    grows to the data set's size); a cached shard of another size than the manifest's is
    downloaded again.

    Raises (from ``reader[i]``) :class:`~vitp.data.base.StorageError` for a shard that cannot be
    fetched, whose tar headers cannot be read, or that holds another number of samples than the
    manifest says (the run stops, naming the shard, instead of skipping all its samples).
    """

    def __init__(self, index: ShardIndex, cache_dir: Optional[str], lru: int):
        from wids.wids_lru import LRUCache

        self.index, self.remote = index, is_remote(index.url)
        self.cache = Path(cache_dir or _default_cache()) / hashlib.sha1(index.url.encode()).hexdigest()[:16]
        self.starts = np.concatenate([[0], np.cumsum([s["nsamples"] for s in index.shards])]).astype(np.int64)
        self.open = LRUCache(max(1, lru), release_handler=lambda _k, tar: tar.close())

    def local_path(self, k: int) -> str:
        """Shard ``k`` as a local file: itself, or its copy in the cache (downloaded if missing)."""
        url = self.index.shards[k]["url"]
        if not self.remote:
            return url
        local = self.cache / os.path.basename(urlparse(url).path)
        _drop_stale(local, self.index.shards[k].get("filesize"))
        if not local.exists():
            import wids.wids_dl

            _use_handlers()
            self.cache.mkdir(parents=True, exist_ok=True)
            part = f"{local}.part{os.getpid()}"
            try:
                wids.wids_dl.download_file_no_log(url, part)
            except Exception as e:  # noqa: BLE001 - handlers raise many types (AssertionError for a failed curl)
                with contextlib.suppress(OSError):
                    os.unlink(part)
                if isinstance(e, StorageError):
                    raise
                raise StorageError(f"shard {url} could not be downloaded ({type(e).__name__}: {e}); check data.shards "
                                   f"and that vitp-pack's output was copied whole, then resume the run") from e
            os.replace(part, local)
        return str(local)

    def shard(self, k: int) -> Any:
        """The open ``wids.IndexedTarSamples`` of shard ``k``."""
        tar = self.open[k]
        if tar is None:
            from wids.wids import IndexedTarSamples

            url, want = self.index.shards[k]["url"], self.index.shards[k]["nsamples"]
            path = self.local_path(k)
            try:
                tar = IndexedTarSamples(path=path)
            except Exception as e:  # noqa: BLE001 - a damaged header fails the whole shard's index
                raise StorageError(f"shard {url} is damaged: its tar headers cannot be read ({type(e).__name__}: "
                                   f"{e}); copy it again or {REPACK_SHARD}, then resume the run") from None
            if len(tar) != want:
                tar.close()
                raise StorageError(f"shard {url} holds {len(tar)} samples, the manifest says {want}: it is damaged "
                                   f"or from another pack; copy it again or {REPACK_SHARD}, then resume the run")
            self.open[k] = tar
        return tar

    def __getitem__(self, i: int) -> Dict[str, bytes]:
        k = int(self.index.shard_of[int(i)])
        sample = self.shard(k)[int(i) - int(self.starts[k])]  # wids keys the files by ".ext"
        return {key.lstrip("."): v.getvalue() for key, v in sample.items() if not key.startswith("_")}


def shard_name(k: int) -> str:
    """File name of shard ``k``."""
    return f"shard-{k:06d}.tar"


def _drop_stale(local: Path, size: Optional[int]) -> None:
    """Delete a cached shard of another size than the manifest's (left by an earlier pack at the
    same URL, or cut short outside vitp), so that wids downloads it again instead of reading it."""
    with contextlib.suppress(FileNotFoundError):
        got = local.stat().st_size
        if size is not None and got != size:
            log.warning(f"cached shard {local} has {got} bytes, the manifest says {size}: downloading it again")
            local.unlink()


def _default_cache() -> str:
    return os.path.join(os.environ.get("VITP_CACHE_DIR") or os.path.expanduser("~/.cache/vitp"), "shards")


def media_of(sample: Dict[str, bytes]) -> Tuple[str, bytes]:
    """``(extension, bytes)`` of a sample's media file (the entry that is not ``cls``/``txt``/``json``).
    Raises ``KeyError`` for a sample without one."""
    for ext, data in sample.items():
        if ext not in META_EXTS:
            return ext, data
    raise KeyError(f"the sample holds no media file (only {', '.join(sample)})")


class SampleBytes(io.BytesIO):
    """A packed sample's media bytes as a file object named ``<shard url>#<key>.<ext>`` (its tar
    member), so that decoders' errors name the sample: Pillow writes a file object's ``repr``,
    PyAV its ``name`` (else ``<_io.BytesIO object at ...>`` or ``'<none>'`` reached the skip warnings)."""

    def __init__(self, data: bytes, name: str):
        super().__init__(data)
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _SampleNames(Sequence):
    """``files`` of a sharded data set: the name of sample ``i`` (``<shard url>#<key>``), made on demand."""

    def __init__(self, index: ShardIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        return f"{self.index.shards[self.index.shard_of[int(i)]]['url']}#{int(i):09d}"


class _Shards:
    """What the sharded datasets share: the index and the per-process reader (opened lazily, dropped
    when pickled into a DataLoader worker)."""

    _per_process = ("_lock", "_reader")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        self._reader = None

    def _sample(self, i: int) -> Dict[str, bytes]:
        if self._reader is None:  # opened in the process that reads (DataLoader workers: their own)
            self._reader = ShardReader(self.index, self.cache_dir, self.lru)
        return self._reader[i]

    def _undecodable(self, bad: Sequence[int], why: str = "") -> str:
        """The :class:`~vitp.data.base.UnreadableData` message of a pack: the shards holding the
        samples that failed (``bad``: file numbers; ``why``: the first one's error) and the fix."""
        samples = self.samples_of(np.asarray(bad, dtype=np.int64)) if hasattr(self, "samples_of") else bad
        shards = sorted({self.index.shards[int(k)]["url"] for k in self.index.shard_of[np.asarray(samples)]})
        shown = ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")
        return (f"none of the {len(self.files)} samples of the pack data.shards={self.index.url} could be decoded "
                f"({self._example(bad, why)}): the damaged samples are in {shown}; delete "
                f"{'that shard' if len(shards) == 1 else 'those shards'} and re-run the same vitp-pack command "
                f"(it writes missing shards again), or pack the source data again")


class ShardImages(_Shards, FileDataset):
    """The images of a packed data set: item ``i`` is sample ``i``, decoded and transformed as
    :class:`~vitp.data.images.ImageFolderDataset` does (digits: as
    :class:`~vitp.data.images.DigitsDataset`), so a packed folder trains on the same tensors.

    ``x`` float32 ``(C, 1, H, W)`` in ``[-1, 1]``. A sample that fails to decode is warned about
    once, listed in ``skipped_files`` and replaced by the next decodable one (as for folders).

    Raises ``ValueError`` for ``channels`` other than 1 or 3 (digits: 1).
    """

    kind, skip_label = "image", "undecodable sample"

    def __init__(self, index: ShardIndex, resolution: Any, channels: int, train: bool = True,
                 random_crop: bool = True, hflip: bool = True, cache_dir: Optional[str] = None, lru: int = 16):
        self.index, self.cache_dir, self.lru = index, cache_dir, lru
        super().__init__(resolution, channels, train)
        if self.channels not in (1, 3) or (index.kind == "digits" and self.channels != 1):
            raise ValueError(f"data.channels={channels} does not fit the packed {index.kind} data at {index.url} "
                             f"(use {'1' if index.kind == 'digits' else '3 (RGB) or 1 (grey)'})")
        self.files, self.labels, self.classes = _SampleNames(index), index.label, index.classes
        self._make_transforms(random_crop, hflip, pre=[self.cover_resize()])

    def _file_of(self, index: int) -> int:
        return index

    def native_sizes(self, items: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """int32 ``(h, w)`` of ``items`` as displayed (bucket assignment); None for the digits."""
        return None if self.index.kind == "digits" else (self.index.height[items], self.index.width[items])

    def native_size(self, index: int) -> Optional[Tuple[int, int]]:
        """``(h, w)`` as displayed, from the manifest; None for the digits (rendered at any size)."""
        return None if self.index.kind == "digits" else (int(self.index.height[index]), int(self.index.width[index]))

    def _read(self, index: int, aug_seed: Optional[int]) -> np.ndarray:
        ext, data = media_of(self._sample(index))
        if ext == "npy":
            return np.load(io.BytesIO(data))
        r = max(self.size)
        return load_image(SampleBytes(data, f"{self.files[index]}.{ext}"), self.channels, draft=(r, r))

    def _augment(self, data: np.ndarray, aug_seed: Optional[int]) -> np.ndarray:
        return data if self.index.kind == "digits" else super()._augment(data, aug_seed)

    def _to_tensor(self, out: np.ndarray) -> torch.Tensor:
        if self.index.kind == "digits":
            return digits_tensor(out[None], self.size)[0]
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))).unsqueeze(1)


class ShardLatents(KeyedDataset):
    """Sample ``i`` of the latent pack ``index`` (a :class:`vitp.data.shards.ShardIndex` of kind
    ``latent``): ``x`` float32 ``(C', T', h, w)``, the normalised latent.

    With a training key ``(i, aug_seed)`` the latent is drawn from the stored posterior,
    ``mean + std * eps`` with ``eps`` from a generator seeded by ``aug_seed`` alone (the same item
    and seed give the same latent in any process and layout, as an augmentation does); ``aug_seed
    = None`` (held-out items) gives the mean. This is the reparameterised sample of latent
    diffusion's training (Rombach et al. 2022, arXiv 2112.10752; diffusers' ``latent_dist.sample``).

    Raises ``ValueError`` when a stored latent's shape differs from the manifest's (a damaged pack)."""

    kind = "latent"

    def __init__(self, index: Any, cache_dir: Optional[str] = None, lru: int = 16):
        self.index, self.cache_dir, self.lru = index, cache_dir, lru
        self.labels, self.classes = index.label, index.classes
        self.files = _SampleNames(index)
        self.item_group = index.shard_of  # item i is sample i
        self.shape = tuple(int(v) for v in index.meta["latent"]["shape"])
        self._reader = None

    def _file_of(self, index: int) -> int:
        return index

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _reader=None)  # each DataLoader worker opens its own shards

    def _posterior(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        if self._reader is None:
            self._reader = ShardReader(self.index, self.cache_dir, self.lru)
        sample = self._reader[i]
        mean, std = (np.load(io.BytesIO(sample[k])) for k in ("mean.npy", "std.npy"))
        if mean.shape != self.shape or std.shape != self.shape:
            raise ValueError(f"{self.files[i]}: latent of shape {mean.shape}, the manifest says {self.shape}: its "
                             f"shard is damaged; {REPACK_SHARD}")
        return mean, std

    def __getitem__(self, key: Any) -> Tuple[torch.Tensor, int]:
        """``(x, label)``; see the class docstring and :meth:`KeyedDataset.__getitem__`."""
        i, aug_seed = parse_key(key, len(self))
        mean, std = self._posterior(i)
        x = torch.from_numpy(mean)
        if aug_seed is not None:
            eps = torch.randn(self.shape, generator=torch.Generator().manual_seed(int(aug_seed)))
            x = x + torch.from_numpy(std) * eps
        return x, int(self.labels[i])


class _KeptNames(Sequence):
    """``files`` of :class:`ShardVideos`: the name of the sample behind file ``f``, made on demand."""

    def __init__(self, index: ShardIndex, sample_of_file: np.ndarray):
        self.names, self.sample_of_file = _SampleNames(index), sample_of_file

    def __len__(self) -> int:
        return len(self.sample_of_file)

    def __getitem__(self, f: int) -> str:
        return self.names[int(self.sample_of_file[int(f)])]


def _dtype(n: int) -> type:
    """int32 for indices below ``n`` when they fit, else int64."""
    return np.int32 if n < 2**31 else np.int64


def _constant_or(a: np.ndarray, n: Optional[int] = None) -> np.ndarray:
    """``a`` (length ``n``, default ``len(a)``), or a read-only broadcast of its one value when all
    its entries are equal (no memory per entry)."""
    n = len(a) if n is None else n
    if len(a) and (a == a[0]).all():
        return np.broadcast_to(a[:1].copy(), (n,))
    return a


def _small(n: int) -> type:
    """The smallest signed int type for values of magnitude below ``n`` (int16, int32, int64)."""
    return np.int16 if n < 2**15 else _dtype(n)


def _count_le(v: np.ndarray, n: np.ndarray, fps: np.ndarray) -> np.ndarray:
    """int64: how many of the frame times ``np.arange(n) / fps`` are ``<= v``, per sample, exactly
    as ``np.searchsorted(np.arange(n) / fps, v, side="right")`` counts them (the same float64
    divisions), without making the times: an estimate from ``v * fps`` corrected by +-1 steps."""
    j = np.clip(np.floor(v * fps).astype(np.int64) + 1, 0, n)
    while True:
        down = (j > 0) & ((j - 1) / fps > v)
        up = ~down & (j < n) & (j / fps <= v)
        if not (down.any() or up.any()):
            return j
        j = j - down + up


# ShardVideos layouts by (manifest's frames array, clip settings): the data sets of each shape bucket
# share one (the arrays are never written after the build); the frames array is held, so its id stays unique
_LAYOUTS: Dict[tuple, tuple] = {}
_LAYOUT_STATE = ("_kept", "_first", "_last", "_train_last", "_span", "_step", "_number", "classes", "dropped_classes", "files",
                 "skipped_files", "skip_reasons", "too_short_files")


class ShardVideos(_Shards, VideoFolderDataset):
    """The clips of a packed video data set: each sample is one video file; its items are the clip
    windows :class:`~vitp.data.video.VideoFolderDataset` cuts from it, laid out from the manifest's
    frame count and frame rate (frame ``k`` at ``k / fps``: exact for constant-frame-rate video) and
    decoded from the sample's bytes. ``sample_of_item[i]`` is the sample of item ``i``.

    The layout is numpy arrays computed from the manifest's per-sample arrays (per usable sample:
    frames, fps, window step, last clip start, longest clip span; per item: file and window), the
    same items and windows the folder dataset makes from the per-frame times, which are computed
    when an item is read (``k / fps``), never stored.

    Parameters: ``index`` and the clip settings of :class:`~vitp.data.video.VideoFolderDataset`.

    Raises ``ValueError`` for settings the manifest cannot serve (scene cuts) and as the folder
    dataset for bad clip settings or no usable clip.
    """

    def __init__(self, index: ShardIndex, cache_dir: Optional[str] = None, lru: int = 16, **clip):
        if clip.get("scene_cut_threshold") is not None:
            raise ValueError("data.scene_cut_threshold is not available on packed videos (the manifest holds no "
                             "shot boundaries); unset it or train from the video folder")
        self.index, self.cache_dir, self.lru = index, cache_dir, lru
        super().__init__(**clip)

    def _find(self, files, class_per_file: bool) -> None:
        return None  # the samples are the manifest's (_build reads its arrays)

    def _layout(self, frames: np.ndarray, fps: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(last clip start, span of the clip at frame 0, longest span)`` per sample of
        ``frames`` frames at ``fps`` (frames; last start < 0: too short), as ``_index_files`` finds
        them from the times ``arange(frames) / fps``; in chunks, so temporaries stay a constant."""
        out = np.zeros((3, len(frames)), dtype=_small(int(frames.max(initial=0)) + 1))
        for a in range(0, len(frames), _CHUNK):
            got = self._layout_chunk(frames[a:a + _CHUNK].astype(np.int64), fps[a:a + _CHUNK].astype(np.float64))
            out[:, a:a + _CHUNK] = got
        return out[0], out[1], out[2]

    def _layout_chunk(self, n: np.ndarray, fps: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_layout` of int64 frame counts ``n`` at float64 ``fps`` (int64 results)."""
        if self.fps is None:
            span = np.full(len(n), (self.num_frames - 1) * self.frame_stride + 1, dtype=np.int64)
            return n - span, span, span
        reach = (self.num_frames - 1) / self.fps
        last = _count_le((n - 1) / fps - reach + 1e-6, n, fps) - 1
        span0 = _count_le(np.full(len(n), reach) + 1e-6, n, fps)  # the clip at frame 0 (time 0.0)
        at_last = _count_le(np.maximum(last, 0) / fps + reach + 1e-6, n, fps) - np.maximum(last, 0)
        # a span is the same at every start unless fps * reach sits within rounding of an integer
        x = fps * (reach + 1e-6)
        odd = (np.abs(x - np.round(x)) < 1e-7) | (at_last != span0)
        longest = span0.copy()
        for i in np.flatnonzero(odd & (last >= 0)):  # rare: every start's span, as the folder dataset does
            times, starts = np.arange(int(n[i])) / fps[i], np.arange(int(last[i]) + 1)
            spans = self._clip_offsets(times, starts)[:, -1] - starts + 1
            span0[i], longest[i] = spans[0], spans.max()
        return last, span0, longest

    def _build(self, _sources: None) -> None:
        key = (id(self.index.frames), self.num_frames, self.frame_stride, self.fps, self.clip_step)
        hit = _LAYOUTS.get(key)
        if hit is not None and hit[0] is self.index.frames:  # another shape bucket of the same clips
            self.__dict__.update({k: list(v) if isinstance(v, list) else v for k, v in hit[1].items()})
            self.skip_reasons = dict(self.skip_reasons)
        else:
            self._lay_out()
            while len(_LAYOUTS) >= 4:
                _LAYOUTS.pop(next(iter(_LAYOUTS)))
            _LAYOUTS[key] = (self.index.frames, {k: getattr(self, k) for k in _LAYOUT_STATE})
        n = int(self._first[-1])
        self.labels = ItemArray(self._labels_at, n)
        self.item_group = ItemArray(self._groups_at, n, np.int32)

    def _labels_at(self, items: np.ndarray) -> np.ndarray:
        return self._number[self.index.label[self.samples_of(self.files_of(items))]]

    def _groups_at(self, items: np.ndarray) -> np.ndarray:
        return self.index.shard_of[self.samples_of(self.files_of(items))]

    def _windows_at(self, items: np.ndarray) -> np.ndarray:
        return items - self._first[self.files_of(items)]

    def _samples_at(self, items: np.ndarray) -> np.ndarray:
        return self.samples_of(self.files_of(items))

    def _lay_out(self) -> None:
        """The per-file arrays of the manifest's samples (:meth:`_build` without the memo): per usable
        sample its number (``_kept``; None when all are usable), first item (``_first``, then the
        number of items), last clip start, longest span and window step, in the smallest int types."""
        ix = self.index
        last, span0, longest = self._layout(ix.frames, ix.fps)
        names = _SampleNames(ix)
        short = np.flatnonzero(last < 0)
        for i in short:  # too short: said per sample, as for a folder
            self._skip(names[i], self._too_short(np.arange(int(ix.frames[i])) / float(ix.fps[i])), too_short=True)
        if len(short) == len(ix):
            raise ValueError(self._no_usable_video())
        self._kept = None
        if len(short):
            self._kept = np.flatnonzero(last >= 0).astype(_dtype(len(ix)))
            last, span0, longest = last[self._kept], span0[self._kept], longest[self._kept]
        # a span or step that is one number for all files (fps unset; clip_step set) is no array
        self._last, self._span = last, _constant_or(longest)
        self._step = _constant_or(np.full(1, self.clip_step, dtype=last.dtype) if self.clip_step else span0, len(last))
        del span0, longest
        self._train_last = self._last_before_tails()
        # windows per file, summed in chunks (int32 when the frame count bounds the total)
        self._first = np.zeros(len(last) + 1, dtype=_dtype(int(ix.frames.sum(dtype=np.int64)) + 1))
        for a in range(0, len(last), _CHUNK):
            part = slice(a, a + _CHUNK)
            self._first[a + 1:a + 1 + len(last[part])] = self._first[a] + np.cumsum(last[part] // self._step[part] + 1)
        self._labels_of()
        self.files = _KeptNames(ix, self._kept) if self._kept is not None else names

    def _last_before_tails(self) -> np.ndarray:
        """Per usable file, the last start of a training clip: ``_last``, or before a held-out tail
        (``heldout_from`` inside the file) the last start whose longest clip ends before it, as the
        folder dataset cuts the jitter of the windows before its held-out clips
        (:meth:`~vitp.data.video.VideoFolderDataset.disjoint_train`). ``_last`` itself without tails."""
        out = None
        for a in range(0, len(self._last), _CHUNK):
            part = slice(a, a + _CHUNK)
            s = self.samples_of(np.arange(a, min(a + _CHUNK, len(self._last))))
            hf, n = self.index.heldout_from[s].astype(np.int64), self.index.frames[s].astype(np.int64)
            tail = (hf > 0) & (hf < n)
            if tail.any():
                out = self._last.copy() if out is None else out
                cap = hf - np.asarray(self._span[part], dtype=np.int64)
                out[part] = np.where(tail, np.minimum(self._last[part], cap), self._last[part])
        return self._last if out is None else out

    def samples_of(self, files: np.ndarray) -> np.ndarray:
        """The sample numbers of the usable files ``files`` (an int array or an int)."""
        return files if self._kept is None else self._kept[files]

    def files_of(self, items: np.ndarray) -> np.ndarray:
        """The file number of each item of the int array ``items``."""
        # keys of _first's own type: numpy would otherwise convert all of _first for every call
        return np.searchsorted(self._first, np.asarray(items).astype(self._first.dtype, copy=False), side="right") - 1

    def _item_at(self, index: int) -> Tuple[int, int]:
        n = int(self._first[-1])
        i = int(index) + (n if int(index) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"item {int(index)} out of range for {n} items")
        f = int(np.searchsorted(self._first, self._first.dtype.type(i), side="right")) - 1
        return f, i - int(self._first[f])

    @property
    def item_file(self) -> ItemArray:
        """The file number of each item (computed when indexed)."""
        return ItemArray(self.files_of, int(self._first[-1]))

    @property
    def item_window(self) -> ItemArray:
        """The window number of each item within its file (computed when indexed)."""
        return ItemArray(self._windows_at, int(self._first[-1]))

    @property
    def sample_of_item(self) -> ItemArray:
        """The sample number of each item (computed when indexed)."""
        return ItemArray(self._samples_at, int(self._first[-1]))

    def _labels_of(self) -> None:
        """``_number`` (label of each manifest class; -1: dropped), ``classes`` and ``dropped_classes``
        as the folder dataset numbers them: classes in order of first appearance among the usable
        samples (a class left without one is dropped)."""
        def by_first_appearance(samples: Optional[np.ndarray]) -> np.ndarray:
            total = len(self.index) if samples is None else len(samples)
            first = np.full(len(self.index.classes), total, dtype=np.int64)
            for a in range(0, total, _CHUNK):  # chunks: np.unique's sort temporaries stay small
                part = slice(a, a + _CHUNK)
                labels = self.index.label[part] if samples is None else self.index.label[samples[part]]
                uniq, at = np.unique(labels, return_index=True)
                first[uniq] = np.minimum(first[uniq], at + a)
            return np.argsort(first, kind="stable")[:int((first < total).sum())]

        order = by_first_appearance(self._kept)
        self._number = np.full(len(self.index.classes), -1, dtype=np.int64)
        self._number[order] = np.arange(len(order))
        self.classes = [self.index.classes[int(c)] for c in order]
        used = set(order.tolist())
        self.dropped_classes = [self.index.classes[int(c)] for c in by_first_appearance(None) if c not in used]
        for c in self.dropped_classes:
            log.warning(f"class {c} dropped: none of its videos is usable (their skips are listed above)")

    def item_bounds(self, items: Any = slice(None)) -> Tuple[np.ndarray, np.ndarray]:
        """``(first frame of each item's eval clip, last frame any of its training clips can touch)``
        of the ``items`` (an int array or a slice): ``clip_indices(i, None)[1].min()`` and
        ``item_frames(i)[1][1]`` (:class:`~vitp.data.video.VideoFolderDataset`) for many items at once."""
        if isinstance(items, slice):
            items = np.arange(*items.indices(int(self._first[-1])))
        f = self.files_of(items)
        step = self._step[f].astype(np.int64)
        start = (items - self._first[f]) * step
        return start, np.maximum(start, np.minimum(start + step - 1, self._train_last[f])) + self._span[f] - 1

    def _window(self, f: int, w: int) -> Tuple[int, int, int, int]:
        step = int(self._step[f])
        return w * step, step, int(self._train_last[f]), int(self._span[f])

    def _file_times(self, f: int) -> np.ndarray:
        s = int(self.samples_of(int(f)))  # constant frame rate: frame k at k / fps
        return np.arange(int(self.index.frames[s])) / float(self.index.fps[s])

    def _file_pts(self, f: int) -> None:
        return None  # no timestamps in the manifest: files are decoded from the start

    def _orientation_of(self, f: int) -> Optional[str]:
        return self.index.orientation_of(int(self.samples_of(int(f))))

    def native_sizes(self, items: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """int32 ``(h, w)`` of the frames of ``items`` as players show them (bucket assignment)."""
        s = self.samples_of(self.files_of(np.asarray(items)))
        return self.index.height[s], self.index.width[s]

    def native_size(self, index: int) -> Tuple[int, int]:
        """``(h, w)`` of the frames of item ``index`` as players show them, from the manifest."""
        s = int(self.samples_of(self._item_at(index)[0]))
        return int(self.index.height[s]), int(self.index.width[s])

    def _decoded_bytes(self) -> int:
        """Bytes the whole-file cache would hold, or a lower bound of them (frames x H x W x C: the
        cover resize never shrinks below the crop) when that already exceeds ``video_cache_mb``,
        so that a large pack's sizes are not read at start-up."""
        (H, W), frames = self.size, 0
        for a in range(0, len(self._last), _CHUNK):
            frames += int(self.index.frames[self.samples_of(np.arange(a, min(a + _CHUNK, len(self._last))))].sum())
        if frames * H * W * self.channels > self.video_cache_mb * 2**20:
            return frames * H * W * self.channels
        total = 0
        for a in range(0, len(self._last), _CHUNK):  # chunks: float64 temporaries stay small
            s = self.samples_of(np.arange(a, min(a + _CHUNK, len(self._last))))
            h, w = self.index.height[s].astype(np.float64), self.index.width[s].astype(np.float64)
            scale = np.maximum(H / h, W / w)  # the cover resize's scale, as the folder dataset's sum
            pw, ph = (np.maximum(1, np.round(side * scale)).astype(np.int64) for side in (w, h))
            px = pw * ph
            total += int((self.index.frames[s].astype(np.int64) * px).sum())
        return total * self.channels

    def _source(self, f: int) -> Any:
        ext, data = media_of(self._sample(int(self.samples_of(int(f)))))
        return SampleBytes(data, f"{self.files[f]}.{ext}")


_INDEXES: Dict[str, ShardIndex] = {}  # the last ShardIndex per URL: the shape buckets of a run share one


def _open_index(url: str) -> ShardIndex:
    """The :class:`ShardIndex` at ``url``, the one already open when its manifest is unchanged
    (same bytes); the shards are checked again either way."""
    index = _INDEXES.get(str(url))
    if index is not None:
        try:
            same = hashlib.sha1(read_bytes(join_url(index.url, MANIFEST))).hexdigest() == index.manifest_sha1
        except OSError:
            same = False
        if same:
            index.check_shards()
            return index
    _INDEXES.clear()
    _INDEXES[str(url)] = index = ShardIndex(url)
    return index


def _split(index: ShardIndex, base: Any, n: int, keep: Any = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(training items, held-out items)`` of the ``n`` items of ``base``, int32 where they fit:
    the manifest's flag for images; for clips, held out when the eval clip starts at or after its
    file's ``heldout_from``, training when every jittered clip ends before it (windows across the
    boundary are used by neither). Items without a caption are left out when the pack has
    captions, and those ``keep(base, items)`` (a bool mask) rejects. In chunks: one byte per item
    while splitting next to the int indices, no other temporary of all items."""
    video, present = index.kind == "video", None if index.captions is None else index.captions.present
    # 1 training, 2 held out, 0 neither: one byte per item while split, in pages of its own (an
    # anonymous mmap) so that freeing it does not raise glibc's mmap threshold for what follows
    side = np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)[:n]
    counts = np.zeros(3, dtype=np.int64)
    for a in range(0, n, _CHUNK):  # chunks: the frame arithmetic's temporaries stay small
        items = np.arange(a, min(n, a + _CHUNK), dtype=np.int64)
        sample = base.samples_of(base.files_of(items)) if video else items
        if video:
            start = index.heldout_from[sample]
            first, last = base.item_bounds(items)
            got = np.where(last < start, 1, np.where(first >= start, 2, 0)).astype(np.uint8)
        else:
            got = np.where(index.heldout[sample] != 0, 2, 1).astype(np.uint8)
        if present is not None:
            got[~present[sample]] = 0
        if keep is not None:
            got[~keep(base, items)] = 0
        side[a:a + len(items)] = got
        counts += np.bincount(got, minlength=3)
    # filled chunk by chunk: no temporary of all items (a bucket's split then peaks at the same
    # bytes per item as an unbucketed one, whatever the buckets already hold)
    out, at = [np.empty(int(counts[k]), dtype=_dtype(n)) for k in (1, 2)], [0, 0]
    for a in range(0, n, _CHUNK):
        for j, k in enumerate((1, 2)):
            got = np.flatnonzero(side[a:a + _CHUNK] == k) + a
            out[j][at[j]:at[j] + len(got)] = got
            at[j] += len(got)
    return out[0], out[1]


def shard_datasets(cfg: Any, keep: Any = None) -> Tuple[KeyedSubset, KeyedSubset]:
    """``(train, held_out)`` of the packed data set at ``cfg.shards`` (a ``data`` config section);
    the split is the manifest's; ``keep(base, items)`` (bool mask, optional) selects a shape
    bucket's items while splitting. The base dataset's ``item_group`` (shard of each item) gives
    the subsets their ``groups`` (:class:`~vitp.data.base.KeyedSubset`).

    Raises ``ValueError`` when ``data.shards`` is unset, the classes disagree with
    ``data.num_classes`` or the training split is empty (without ``keep``); what
    :class:`ShardIndex` raises."""
    if not cfg.shards:
        raise ValueError("data.name=shards needs data.shards=<folder or s3:// prefix written by vitp-pack>")
    index = _open_index(cfg.shards)
    if len(index.classes) != cfg.num_classes:
        raise ValueError(f"the packed data at {cfg.shards} has {len(index.classes)} classes but data.num_classes="
                         f"{cfg.num_classes}; set data.num_classes={len(index.classes)}")
    common = dict(cache_dir=cfg.shard_cache, lru=max(4, int(cfg.shuffle_window) + 2))
    if index.kind == "latent":
        base = ShardLatents(index, **common)
        captions = index.captions
    elif index.kind == "video":
        base = ShardVideos(index, resolution=cfg.resolution, num_frames=cfg.num_frames,
                           frame_stride=cfg.frame_stride, fps=cfg.fps, clip_step=cfg.clip_step,
                           channels=cfg.channels, train=True, random_crop=cfg.random_crop, hflip=cfg.hflip,
                           video_cache_mb=cfg.video_cache_mb, scene_cut_threshold=cfg.scene_cut_threshold,
                           **common)
        captions = None if index.captions is None else Picked(index.captions, base.sample_of_item)
    else:
        if cfg.num_frames != 1:
            raise ValueError(f"the packed data at {cfg.shards} holds still images: set data.num_frames=1")
        base = ShardImages(index, cfg.resolution, cfg.channels, train=True, random_crop=cfg.random_crop,
                           hflip=cfg.hflip, **common)
        base.item_group, captions = index.shard_of, index.captions  # item i is sample i
    if captions is not None:
        base.captions = captions  # parsed when an item asks
    train, held = _split(index, base, len(base), keep)
    out = [KeyedSubset(base, train), KeyedSubset(base, held, eval_only=True)]
    if not len(out[0]) and keep is None:
        raise ValueError(f"the packed data at {cfg.shards} has no training sample")
    line = (f"data.shards={cfg.shards}: {len(index)} samples in {len(index.shards)} shards, {len(out[0])} "
            f"training / {len(out[1])} held-out items")
    if line not in _LOGGED:  # built once per bucket: said once
        _LOGGED.add(line)
        log.info(line)
    return out[0], out[1]


def item_samples(dataset: Any, items: np.ndarray) -> np.ndarray:
    """The pack's sample numbers of ``items`` (int array) of ``dataset``: a packed data set or
    :class:`~vitp.data.base.KeyedSubset` views of one."""
    while isinstance(dataset, KeyedSubset):
        items, dataset = np.asarray(dataset.indices[items]), dataset.base
    return dataset.samples_of(dataset.files_of(items)) if isinstance(dataset, ShardVideos) else items


def caption_ids(index: ShardIndex, store: Any, cache_dir: Optional[str] = None) -> np.ndarray:
    """int32 ``(samples,)``: the id in the caption store ``store`` (:class:`vitp.text.store.TextEmbeddings`)
    of each sample's caption (-1: no caption, or one the store lacks), memory-mapped from a cache
    file (``<cache>/caption-ids/``, keyed by the pack's manifest and the store's captions), which
    the first process to need it writes: with :func:`vitp.train.trainer.node_first`, one rank per
    node reads the pack's captions, the others map the file.

    Each caption is looked up with :meth:`vitp.text.store.TextEmbeddings.find` (a binary search
    of the store's caption hashes, then the store's line compared)."""
    key = hashlib.sha1(f"{index.url}|{index.manifest_sha1}|{store.index['captions_sha256']}".encode()).hexdigest()
    path = Path(cache_dir or os.path.dirname(_default_cache())) / "caption-ids" / f"{key[:20]}.npy"
    if path.is_file():
        ids = np.load(path, mmap_mode="r")
        if len(ids) == len(index):
            return ids
    ids = np.full(len(index), -1, dtype=np.int32)
    for a in range(0, len(index), _CHUNK):
        part = range(a, min(len(index), a + _CHUNK))
        caps = [index.captions[i] for i in part]
        found = (None if c is None else store.find(c) for c in caps)
        ids[a:a + len(caps)] = [-1 if i is None else i for i in found]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, ids)
    except OSError as e:  # a read-only cache: every process keeps its own copy
        log.warning(f"cannot write the caption-id cache {path} ({e}); set VITP_CACHE_DIR to a writable folder")
    return ids


def packed_index(dataset: Any) -> Optional[ShardIndex]:
    """The :class:`ShardIndex` under ``dataset`` (through ``KeyedSubset.base`` / ``CaptionIds.dataset``), or None."""
    return next((ds.index for ds in wrapped(dataset) if isinstance(getattr(ds, "index", None), ShardIndex)), None)


def as_packed_source(cfg: Any, dataset: Any) -> Any:
    """``cfg`` (a run config) with ``data.name``, ``data.captions`` and ``data.caption_templates``
    of the config ``dataset`` was packed from, when it is a packed data set (else ``cfg``): what the
    evaluation needs to judge packed digits as the digits."""
    index = packed_index(dataset)
    if index is None:
        return cfg
    from omegaconf import OmegaConf

    src = index.meta.get("source", {})
    keep = {k: src[k] for k in ("name", "captions", "caption_templates") if k in src}
    return OmegaConf.merge(cfg, {"data": keep})
