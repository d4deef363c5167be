"""Datasets addressed by ``(index, aug_seed)`` keys, and the shared base of file-backed datasets.

Every dataset returns ``x`` of shape ``(C, T, H, W)``, float32 in ``[-1, 1]`` (an image has
``T = 1``), and an int label. The augmentation of an item is drawn only from the ``aug_seed`` in its
key, so a sampler that hands out keys makes the data pipeline reproducible in any process and in
any order; ``aug_seed=None`` selects the deterministic evaluation transform.
"""
from __future__ import annotations

import functools
import logging
import random
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from vitp.config import parse_resolution
from vitp.remote import StorageError  # noqa: F401 - re-exported: raised by the datasets
from vitp.utils import RANK_LOCAL

log = logging.getLogger(__name__)  # data warnings: one line each, in the run's log under vitp-train
# (skip label, file, reason) already warned in this process (FileDataset._skip)
SKIPS_SAID: set = set()

Key = Union[int, Tuple[int, Optional[int]]]


def parse_key(key: Key, n: int) -> Tuple[int, Optional[int]]:
    """Split a key into ``(index in [0, n), aug_seed)``; a bare int means ``aug_seed=None``.

    Negative indices count from the end, as for a list.

    Raises
    ------
    IndexError
        If the index is not in ``[-n, n)``.
    """
    index, aug_seed = key if isinstance(key, tuple) else (key, None)
    index = int(index)
    if not -n <= index < n:
        raise IndexError(f"index {index} out of range for a dataset of {n} items")
    return index % n, None if aug_seed is None else int(aug_seed)


def files_by_class(root: Path, extensions: Sequence[str], kind: str) -> dict:
    """``{class name: sorted files}`` of a folder: its immediate subfolders are the classes (files
    found recursively inside each); when no subfolder holds a file, the files directly in ``root``
    form one class named after ``root``. Warns about loose files ignored next to class folders and
    about class folders without a file (dropped). ``extensions``: lower-case suffixes; ``kind``
    names the files in the warnings ("image", "video")."""
    def found_in(folder: Path, recursive: bool) -> list:
        found = folder.rglob("*") if recursive else folder.iterdir()
        return sorted(p for p in found if p.is_file() and p.suffix.lower() in extensions)

    subdirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    groups = {d.name: found_in(d, True) for d in subdirs}
    if not any(groups.values()):
        return {root.name: found_in(root, False)}
    loose = found_in(root, False)
    if loose:
        log.warning(f"{len(loose)} {kind}(s) directly in {root} are ignored: with class subfolders present, "
                      f"only {kind}s inside them are used")
    for name in [n for n, files in groups.items() if not files]:
        log.warning(f"class folder {root / name} holds no {kind}; it is not a class")
        del groups[name]
    return groups


class KeyedDataset(Dataset):
    """Base class: items addressed by ``(index, aug_seed)``.

    Attributes
    ----------
    labels : np.ndarray
        int64, shape ``(len,)``: the class of each item.
    classes : list of str
        Class names; ``len(classes)`` is the number of classes.
    """

    labels: np.ndarray
    classes: list

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are ``0 .. num_classes - 1``)."""
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        """Return ``(x, label)``.

        Parameters
        ----------
        key : (int, int or None), or int
            ``(index, aug_seed)``. ``aug_seed=None`` gives the deterministic eval transform (center
            crop, no flip); an int gives a random augmentation drawn only from that seed, so equal
            seeds give bit-identical outputs in any process. A bare int means ``(index, None)``.

        Returns
        -------
        x : torch.Tensor
            float32, shape ``(C, T, H, W)``, values in ``[-1, 1]``.
        label : int

        Raises
        ------
        IndexError
            If the index is out of range.
        """
        raise NotImplementedError


def runs(values: Any, chunk: int = 1 << 14) -> np.ndarray:
    """Lengths of the runs of equal consecutive values, int64 (``[3, 3, 5, 3] -> [2, 1, 1]``).
    ``values``: an array or anything sliced into arrays (an :class:`ItemArray` view), read in chunks."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    cuts, prev = [np.zeros(1, np.int64)], None
    for a in range(0, len(values), chunk):
        part = np.asarray(values[a:a + chunk])
        if prev is not None and part[0] != prev:
            cuts.append(np.asarray([a], np.int64))
        cuts.append(np.flatnonzero(np.diff(part)) + 1 + a)
        prev = part[-1]
    return np.diff(np.concatenate([*cuts, [len(values)]])).astype(np.int64)


class _Gathered:
    """``values[indices]`` sliced on demand (what :func:`runs` reads of a subset's groups)."""

    def __init__(self, values: Any, indices: Any):
        self.values, self.indices = values, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> np.ndarray:
        return np.asarray(self.values[self.indices[part]])


class ItemArray:
    """An integer array of one value per item, computed when indexed: ``values(items)`` maps an
    int64 array of item numbers to their values. Data sets of millions of items (packed video:
    :class:`vitp.data.shards.ShardVideos`) derive per-item facts (file, window, label, shard) from
    per-file arrays instead of storing them. Indexing by an int gives an int; by an array, slice
    or boolean mask an array of ``dtype`` (computed in chunks of ``chunk``); ``np.asarray`` makes
    the whole array."""

    def __init__(self, values: Callable[[np.ndarray], np.ndarray], n: int, dtype: Any = np.int64, chunk: int = 1 << 14):
        self.values, self.n, self.dtype, self.chunk = values, int(n), np.dtype(dtype), chunk

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            k = int(key) + (self.n if int(key) < 0 else 0)
            if not 0 <= k < self.n:
                raise IndexError(f"item {int(key)} out of range for {self.n} items")
            return int(self.values(np.asarray([k], dtype=np.int64))[0])
        if isinstance(key, slice):
            key = np.arange(*key.indices(self.n))
        key = np.asarray(key)
        if key.dtype == bool:
            key = np.flatnonzero(key)
        out = np.empty(len(key), dtype=self.dtype)
        for a in range(0, len(key), self.chunk):
            out[a:a + self.chunk] = self.values(key[a:a + self.chunk].astype(np.int64))
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.n, dtype=self.dtype)
        for a in range(0, self.n, self.chunk):
            out[a:a + self.chunk] = self.values(np.arange(a, min(self.n, a + self.chunk), dtype=np.int64))
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list:
        """The values as a Python list."""
        return np.asarray(self).tolist()


def _as_indices(indices: Any) -> Any:
    """``indices`` as an integer array without a copy where it is one already (or an :class:`ItemArray`)."""
    if isinstance(indices, ItemArray) or (isinstance(indices, np.ndarray) and indices.dtype.kind in "iu"):
        return indices
    return np.asarray(indices, dtype=np.int64)


class Picked(Sequence):
    """``values[indices[i]]`` on access: a view of a lazy sequence (e.g. a pack's captions,
    :class:`vitp.data.shards.CaptionLines`) that makes nothing per item up front (``indices`` is
    kept as given when it is an integer array or an :class:`ItemArray`)."""

    def __init__(self, values: Sequence, indices: Sequence[int]):
        self.values, self.indices = values, _as_indices(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.values[int(self.indices[int(i)])]


class KeyedSubset(KeyedDataset):
    """The items ``indices`` of ``base``; key ``(i, s)`` reads ``base[(indices[i], s)]``.

    Parameters
    ----------
    base : KeyedDataset
    indices : sequence of int
    eval_only : bool
        Replace every ``aug_seed`` by ``None`` (the held-out split uses the eval transform).

    ``captions``: the items' captions when ``base`` has them (:mod:`vitp.data.text`), else None.
    ``groups``: when ``base`` has ``item_group`` (the shard of each item, :mod:`vitp.data.shards`),
    the sizes of the runs of the subset's items in one shard (the epoch order reads them together,
    :func:`vitp.data.loader.epoch_order`), else None.
    ``split_items``: a folder's held-out set keeps the whole split it was cut from (sorted int64
    indices of ``base``, before captions or a bucket dropped any: what
    :func:`vitp.data.heldout_record.record_split` records), else None.
    """

    def __init__(self, base: KeyedDataset, indices: Sequence[int], eval_only: bool = False,
                 split_items: Optional[np.ndarray] = None):
        self.base = base
        self.indices = _as_indices(indices)  # int32 where the caller made it so: 4 bytes per item
        self.eval_only = eval_only
        self.split_items = split_items
        self.classes = base.classes
        captions = getattr(base, "captions", None)
        if captions is None or isinstance(captions, list):
            self.captions = None if captions is None else [captions[i] for i in self.indices]
        else:  # a lazy sequence (a pack's captions): stay lazy
            self.captions = Picked(captions, self.indices)
        item_group = getattr(base, "item_group", None)
        self.groups = None if item_group is None else runs(_Gathered(item_group, self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    @functools.cached_property
    def labels(self) -> np.ndarray:
        """int64 ``(len,)``: the class of each item (made when first asked: not at start-up)."""
        return np.asarray(self.base.labels[self.indices], dtype=np.int64)

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, aug_seed = parse_key(key, len(self))
        return self.base[(int(self.indices[index]), None if self.eval_only else aug_seed)]


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Split item indices into (train, held-out), per class, fixed by ``seed``.

    Each class with ``n`` items holds out ``round(fraction * n)`` of them, at least 1 when
    ``fraction > 0`` and at most ``n - 1`` (a class with a single item stays in train, with a warning).

    Returns
    -------
    train, heldout : np.ndarray
        Sorted int64 indices.

    Raises
    ------
    ValueError
        If ``fraction`` is not in ``[0, 1)``.
    """
    check_holdout_fraction(fraction)
    rng = np.random.default_rng(seed)
    held = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_hold = min(max(round(fraction * len(members)), 1), len(members) - 1) if fraction > 0 else 0
        if fraction > 0 and n_hold == 0:
            log.warning(f"class {c} has a single item: it has no held-out item")
        held.append(members[:n_hold])
    heldout = np.sort(np.concatenate(held)).astype(np.int64)
    return np.setdiff1d(np.arange(len(labels)), heldout).astype(np.int64), heldout


def check_holdout_fraction(fraction: float) -> None:
    """Raise ``ValueError`` unless ``data.holdout_fraction`` is in ``[0, 1)``."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.holdout_fraction must be in [0, 1), got {fraction}")


def error_text(error: BaseException) -> str:
    """``"<type>: <message>"``, how skip warnings name an error."""
    return f"{type(error).__name__}: {error}"




def albumentations() -> Any:
    """The ``albumentations`` module, imported on first use (0.4 s that runs on latents, digits or
    synthetic data do not need), without its PyPI update check (``NO_ALBUMENTATIONS_UPDATE``)."""
    import os

    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import albumentations as A

    return A


class UnreadableData(ValueError):
    """No item of a data set decodes: every file, or every sample of a pack, failed when read.
    Bad input, not a bug: the CLIs report it in one line (:func:`vitp.cli.run_cli`)."""


def check_readable(dataset: Any) -> None:
    """:meth:`FileDataset.check_readable` of the file dataset under ``dataset`` (through
    ``KeyedSubset.base`` / ``.dataset``); nothing for data without files (digits, synthetic)."""
    for ds in wrapped(dataset):
        if isinstance(ds, FileDataset):
            ds.check_readable()
            return


class FileDataset(KeyedDataset):
    """Base of datasets decoded from files (:class:`~vitp.data.images.ImageFolderDataset`,
    :class:`~vitp.data.video.VideoFolderDataset`): the skip list, the seeded augmentation, the
    retry of items whose file fails to decode, and pickling.

    Transform (albumentations, https://albumentations.ai/docs/): ``pre`` (e.g. ``SmallestMaxSize``),
    then ``RandomCrop`` (train and ``random_crop``) or ``CenterCrop`` to ``H x W``,
    ``HorizontalFlip(p=0.5)`` (train and ``hflip``), and scaling of uint8 (or float32 in
    ``[0, 255]``, from deeper sources) to ``[-1, 1]`` (``x / 127.5 - 1``). ``aug_seed=None`` or
    ``train=False`` gives the center crop without flip.
    An int ``aug_seed`` seeds ONE numpy and one python stream shared by all transforms of the call,
    so the crop offset and the flip are drawn independently but only from that seed.

    A file that fails to decode in ``__getitem__`` is warned about once, listed in
    ``skipped_files``, and every item of it is replaced by the next item (cyclically) of a file
    that decodes, so the output stays a function of the key. ``skipped_files`` / ``num_skipped`` and
    the failed files are per process (DataLoader workers keep their own).

    Subclasses set ``files`` (paths), ``labels`` and ``classes``, call :meth:`_make_transforms`, and
    supply :meth:`_file_of`, :meth:`_read` and :meth:`_to_tensor`.

    Parameters
    ----------
    resolution : int, (H, W) or "HxW"
        Output size in pixels (an int: square ``R x R``); :attr:`size` holds ``(H, W)``.
    channels : int
        Output channels C (3 RGB, 1 gray; subclasses check the value).
    train : bool
        Whether an int ``aug_seed`` applies the random transform.
    """

    kind = "file"  # names the files in messages: "image", "video"
    skip_label = "file"  # "skipping <skip_label> <path>: <reason>"
    target = "image"  # albumentations target: "image" (H, W, C) or "images" (T, H, W, C)
    files: List[Path]

    def __init__(self, resolution: Any, channels: int, train: bool):
        self.size = parse_resolution(resolution)  # (H, W)
        self.resolution = self.size[0] if self.size[0] == self.size[1] else self.size  # int when square
        self.channels, self.train = int(channels), train
        self.skipped_files: List[str] = []
        self.skip_reasons: dict = {}  # file -> why it was skipped (vitp-pack's manifest lists them)
        self.too_short_files: List[str] = []  # the skipped files that read but hold no whole clip
        self._bad: set = set()  # numbers of the files that failed to decode in __getitem__
        self._init_process_state()

    # ---------------------------------------------------------------------------- skip list
    @property
    def num_skipped(self) -> int:
        """Files skipped in this process: unreadable ones and (video) ones too short for a clip."""
        return len(self.skipped_files)

    def skip_summary(self) -> str:
        """The skipped files counted by kind, e.g. ``"2 unreadable files, 1 too short"`` ("" if none)."""
        short = len(self.too_short_files)
        parts = [f"{self.num_skipped - short} unreadable file(s)"] if self.num_skipped > short else []
        return ", ".join(parts + ([f"{short} too short for one clip"] if short else []))

    def _skip(self, path: Any, reason: str, too_short: bool = False, rank_local: bool = False) -> None:
        """Warn (one log line, once per file and reason in this process) and list ``path`` as skipped;
        ``too_short``: it reads, but is shorter than one clip; ``rank_local``: met in this rank's
        batches (the scan skips a file on every rank alike)."""
        said = (self.skip_label, str(path), reason)
        if said not in SKIPS_SAID:  # the data set is built again per shape bucket and for captions: said once
            SKIPS_SAID.add(said)
            log.warning(f"skipping {self.skip_label} {path}: {reason}", extra=RANK_LOCAL if rank_local else None)
        self.skipped_files.append(str(path))
        self.skip_reasons[str(path)] = reason
        if too_short:
            self.too_short_files.append(str(path))

    # ---------------------------------------------------------------------------- transform
    def cover_resize(self) -> Any:
        """Aspect-preserving resize to the smallest size that covers ``(H, W)`` (scale
        ``max(H / h, W / w)``; area interpolation when shrinking), which the crop then cuts to
        ``(H, W)``: no squashing. A square output keeps ``SmallestMaxSize(R)`` (the same scale)."""
        A = albumentations()
        H, W = self.size
        if H == W:
            return A.SmallestMaxSize(max_size=H, area_for_downscale="image")
        return A.SmallestMaxSize(max_size_hw=(H, W), area_for_downscale="image")

    def _make_transforms(self, random_crop: bool, hflip: bool, pre: Sequence[Any] = ()) -> None:
        A = albumentations()
        (H, W), train = self.size, self.train
        crop = (A.RandomCrop if train and random_crop else A.CenterCrop)(H, W)
        to_unit = A.Normalize(mean=0.5, std=0.5, max_pixel_value=255.0)  # [0, 255] -> [-1, 1]
        flip = [A.HorizontalFlip(p=0.5)] if train and hflip else []
        self._train_tf = A.Compose([*pre, crop, *flip, to_unit])
        self._eval_tf = A.Compose([*pre, A.CenterCrop(H, W), to_unit])

    def _augment(self, data: np.ndarray, aug_seed: Optional[int]) -> np.ndarray:
        """Float32 ``data`` cropped to ``H x W`` and scaled to ``[-1, 1]``, drawn from ``aug_seed``."""
        if aug_seed is None or not self.train:
            return self._eval_tf(**{self.target: data})[self.target]
        with self._lock:  # set_random_state + call must not interleave across threads
            # one shared stream for all transforms (set_random_seed would give each transform its own
            # copy of the same stream, correlating e.g. the crop offset with the flip decision)
            seed = aug_seed % 2**64
            self._train_tf.set_random_state(np.random.default_rng(seed), random.Random(seed))
            return self._train_tf(**{self.target: data})[self.target]

    # ---------------------------------------------------------------------------- items
    def _file_of(self, index: int) -> int:
        """Number (in ``files``) of the file item ``index`` is read from."""
        raise NotImplementedError

    def _read(self, index: int, aug_seed: Optional[int]) -> np.ndarray:
        """Decoded data of item ``index`` (``(H, W, C)`` or ``(T, H, W, C)``), uint8 or float32 in
        ``[0, 255]``; may raise."""
        raise NotImplementedError

    def _to_tensor(self, out: np.ndarray) -> torch.Tensor:
        """Augmented ``out`` as the ``(C, T, H, W)`` tensor."""
        raise NotImplementedError

    def _undecodable(self, bad: Sequence[int], why: str = "") -> str:
        """Message of the :class:`UnreadableData` raised when no file decodes (``bad``: the
        numbers of the files that failed; ``why``: the first one's error, when not warned about)."""
        return (f"none of the {len(self.files)} {self.kind}s could be decoded ({self._example(bad, why)}); replace "
                f"or remove the damaged files and start again (the start-up scan skips files that do not decode)")

    def _example(self, bad: Sequence[int], why: str) -> str:
        """``"e.g. <first failed file>[: <why>]"`` for the :meth:`_undecodable` messages."""
        return f"e.g. {self.files[min(bad)]}" + (f": {why}" if why else "")

    def check_readable(self) -> None:
        """Return at the first item that decodes; raise :class:`UnreadableData` (naming the files
        or shards and the fix) when none does. A start-up check, before a run writes anything:
        a pack's start-up reads no shard, so a pack whose every sample is damaged otherwise failed
        at the first batch, in a DataLoader worker. Warns, lists and counts nothing (training does)
        and leaves no per-process state (open shards, decoded frames) for the DataLoader workers."""
        failed: dict = {}
        try:
            for j in range(len(self)):
                f = self._file_of(j)
                if f in failed or f in self._bad:
                    continue
                try:
                    self._read(j, None)
                    return
                except StorageError:
                    raise
                except Exception as e:  # noqa: BLE001 - what __getitem__ would skip
                    failed[f] = e
            if failed or self._bad:  # else no item at all: nothing to read
                why = self._decode_failure(failed[min(failed)]) if failed else ""
                raise UnreadableData(self._undecodable(sorted(set(failed) | self._bad), why))
        finally:
            self._init_process_state()

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        """See :meth:`KeyedDataset.__getitem__`; also raises :class:`UnreadableData` when no file
        decodes."""
        index, aug_seed = parse_key(key, len(self))
        for k in range(len(self)):
            j = (index + k) % len(self)
            f = self._file_of(j)
            if f in self._bad:
                continue
            try:
                data = self._read(j, aug_seed)
            except StorageError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a file truncated after it was indexed
                self._bad.add(f)
                self._skip_in_training(f, self._decode_failure(e))
                continue
            return self._to_tensor(self._augment(data, aug_seed)), int(self.labels[j])
        raise UnreadableData(self._undecodable(sorted(self._bad)))

    def _skip_in_training(self, f: int, reason: str) -> None:
        """:meth:`_skip` file ``f``; with :func:`attach_skip_counter`, warned and counted once per run
        (its DataLoader workers each meet it, only the first one warns and counts)."""
        counter, seen = getattr(self, "skip_counter", None), getattr(self, "skip_flags", None)
        if counter is not None and seen is not None:
            with counter.get_lock():
                first, seen[f] = not seen[f], 1
                counter.value += int(first)
            if not first:
                self.skipped_files.append(str(self.files[f]))
                return
        self._skip(self.files[f], reason, rank_local=True)

    def _decode_failure(self, error: Exception) -> str:
        """Reason given in the warning about a file that fails in ``__getitem__``."""
        return error_text(error)

    # ---------------------------------------------------------------------------- pickling
    _per_process = ("_lock",)  # dropped when pickled, rebuilt by _init_process_state

    def _init_process_state(self) -> None:
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in self._per_process:  # locks do not pickle (DataLoader workers with spawn)
            del state[k]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_process_state()


def attach_skip_counter(datasets: Any) -> Any:
    """A counter shared with DataLoader worker processes (``multiprocessing.Value``), attached as
    ``skip_counter`` to the :class:`FileDataset` under each of ``datasets`` (a dataset or a list;
    through ``KeyedSubset.base`` / ``.dataset``), with a shared flag per file (``skip_flags``):
    every file that fails in ``__getitem__`` adds one, once, whichever process met it first.
    Call it before the loader starts its workers. Returns the counter."""
    import multiprocessing

    counter = multiprocessing.Value("q", 0)
    for top in datasets if isinstance(datasets, (list, tuple)) else [datasets]:
        for ds in wrapped(top):
            if isinstance(ds, FileDataset):
                ds.skip_counter = counter
                ds.skip_flags = multiprocessing.Array("b", len(ds.files), lock=False)  # guarded by counter's lock
                break
    return counter


def wrapped(dataset: Any) -> Iterator[Any]:
    """``dataset`` and the datasets it wraps, outermost first (``CaptionIds.dataset``,
    ``KeyedSubset.base``)."""
    while dataset is not None:
        yield dataset
        dataset = getattr(dataset, "base", None) or getattr(dataset, "dataset", None)
