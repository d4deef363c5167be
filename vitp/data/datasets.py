"""Datasets addressed by ``(index, aug_seed)`` keys, and the stratified train / held-out split.

Every dataset returns ``x`` of shape ``(C, T, H, W)``, float32 in ``[-1, 1]`` (an image has
``T = 1``), and an int label. The augmentation of an item is drawn only from the ``aug_seed`` in its
key, so a sampler that hands out keys makes the data pipeline reproducible in any process and in
any order; ``aug_seed=None`` selects the deterministic evaluation transform.
"""
from __future__ import annotations

import random
import threading
import warnings
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import albumentations as A
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from vitp.config import DataConfig
from vitp.objectives.flow import sample_seed

IMAGE_EXTENSIONS = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
DATASET_NAMES = ("digits", "image_folder", "synthetic", "video_folder")
Key = Union[int, Tuple[int, Optional[int]]]


def _parse_key(key: Key, n: int) -> Tuple[int, Optional[int]]:
    """Split a key into ``(index in [0, n), aug_seed)``; a bare int means ``aug_seed=None``."""
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
        warnings.warn(f"{len(loose)} {kind}(s) directly in {root} are ignored: with class subfolders present, "
                      f"only {kind}s inside them are used", stacklevel=3)
    for name in [n for n, files in groups.items() if not files]:
        warnings.warn(f"class folder {root / name} holds no {kind}; it is not a class", stacklevel=3)
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


class KeyedSubset(KeyedDataset):
    """The items ``indices`` of ``base``; key ``(i, s)`` reads ``base[(indices[i], s)]``.

    Parameters
    ----------
    base : KeyedDataset
    indices : sequence of int
    eval_only : bool
        Replace every ``aug_seed`` by ``None`` (the held-out split uses the eval transform).
    """

    def __init__(self, base: KeyedDataset, indices: Sequence[int], eval_only: bool = False):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.eval_only = eval_only
        self.labels = base.labels[self.indices]
        self.classes = base.classes

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, aug_seed = _parse_key(key, len(self))
        return self.base[(int(self.indices[index]), None if self.eval_only else aug_seed)]


class DigitsDataset(KeyedDataset):
    """The 1797 real 8x8 handwritten digits of ``sklearn.datasets.load_digits`` (10 classes).

    ``x = pixels / 8 - 1`` (pixels are 0..16), shape ``(1, 1, R, R)``; bilinearly resized
    (``align_corners=False``) when ``resolution != 8``. No augmentation: ``aug_seed`` is ignored.

    Raises
    ------
    ValueError
        If ``channels != 1`` (the digits are grayscale).
    """

    def __init__(self, resolution: int = 8, channels: int = 1):
        from sklearn.datasets import load_digits

        if channels != 1:
            raise ValueError(f"the digits are grayscale: set data.channels=1 (got {channels})")
        digits = load_digits()
        x = torch.from_numpy(digits.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)  # (N, 1, 8, 8)
        if resolution != 8:
            x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False)
        self.images = x.unsqueeze(2).contiguous()  # (N, C=1, T=1, R, R)
        self.labels = digits.target.astype(np.int64)
        self.classes = [str(c) for c in range(10)]

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, _ = _parse_key(key, len(self))
        return self.images[index].clone(), int(self.labels[index])


class ImageFolderDataset(KeyedDataset):
    """Photos in a folder: the class is the immediate subfolder name (sorted); files are found
    recursively under each class folder. Images lying directly in ``root`` with no subfolders form
    a single class named after ``root``.

    Transform (albumentations): ``SmallestMaxSize(resolution)``, then ``RandomCrop`` (train and
    ``random_crop``) or ``CenterCrop``, ``HorizontalFlip(p=0.5)`` (train and ``hflip``), then
    scaling to ``[-1, 1]``. ``aug_seed=None`` always gives center crop without flip.

    Files that PIL cannot open are skipped with a warning when the index is built; a file that
    still fails to decode in ``__getitem__`` is warned about once and replaced by the next
    decodable index (cyclically), so the output stays deterministic. Skipped files are listed in
    ``skipped_files`` and counted in ``num_skipped`` (per process: DataLoader workers keep their own).

    Parameters
    ----------
    root : str or Path
    resolution : int
        Side R of the square output, in pixels.
    channels : int
        3 (RGB) or 1 (grayscale). Output ``x`` has shape ``(channels, 1, R, R)``.
    train : bool
        Whether an int ``aug_seed`` applies the random crop / flip.
    random_crop, hflip : bool

    Raises
    ------
    FileNotFoundError
        If ``root`` is not an existing directory.
    ValueError
        If ``channels`` is not 1 or 3, or ``root`` holds no readable image.
    """

    def __init__(self, root: Union[str, Path], resolution: int, channels: int = 3, train: bool = True,
                 random_crop: bool = True, hflip: bool = True):
        self.root, self.resolution, self.channels = Path(root).expanduser(), int(resolution), int(channels)
        if self.channels not in (1, 3):
            raise ValueError(f"image_folder supports data.channels=3 (RGB) or 1 (grayscale), got {channels}")
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"image folder {str(self.root)!r} does not exist or is not a directory; "
                f"set data.root=<folder with one subfolder of images per class>")
        self.skipped_files: list = []
        self._bad: set = set()
        self._scan()
        crop = (A.RandomCrop if train and random_crop else A.CenterCrop)(resolution, resolution)
        resize = A.SmallestMaxSize(max_size=resolution, area_for_downscale="image")
        to_unit = A.Normalize(mean=0.5, std=0.5, max_pixel_value=255.0)  # uint8 -> [-1, 1]
        flip = [A.HorizontalFlip(p=0.5)] if train and hflip else []
        self._train_tf = A.Compose([resize, crop, *flip, to_unit])
        self._eval_tf = A.Compose([resize, A.CenterCrop(resolution, resolution), to_unit])
        self._lock = threading.Lock()  # set_random_seed + call must not interleave across threads

    @property
    def num_skipped(self) -> int:
        return len(self.skipped_files)

    def _scan(self) -> None:
        groups = files_by_class(self.root, IMAGE_EXTENSIONS, "image")
        files, labels = [], []
        for label, name in enumerate(groups):
            for path in groups[name]:
                try:
                    with Image.open(path) as im:
                        im.verify()
                except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
                    self._skip(path, e)
                    continue
                files.append(path)
                labels.append(label)
        if not files:
            raise ValueError(
                f"no readable image under {str(self.root)!r} (skipped {self.num_skipped} unreadable); accepted "
                f"extensions (case-insensitive): {', '.join(IMAGE_EXTENSIONS)}. Put images in <root>/<class>/ "
                f"subfolders, or directly in <root> for a single class")
        self.files, self.labels, self.classes = files, np.asarray(labels, dtype=np.int64), list(groups)

    def _skip(self, path: Path, error: Exception) -> None:
        warnings.warn(f"skipping unreadable image {path}: {type(error).__name__}: {error}", stacklevel=3)
        self.skipped_files.append(str(path))

    def _load(self, path: Path) -> np.ndarray:
        """Decode to uint8 ``(H, W, channels)``."""
        mode = "RGB" if self.channels == 3 else "L"
        with Image.open(path) as im:
            im.draft(mode, (self.resolution, self.resolution))  # JPEG: decode at a reduced size >= R
            arr = np.asarray(im.convert(mode))
        return arr if arr.ndim == 3 else arr[..., None]

    def _transform(self, image: np.ndarray, aug_seed: Optional[int]) -> torch.Tensor:
        if aug_seed is None:
            out = self._eval_tf(image=image)["image"]
        else:
            with self._lock:
                # one shared stream for all transforms (set_random_seed would give each transform its own
                # copy of the same stream, correlating e.g. the crop offset with the flip decision)
                seed = aug_seed % 2**64
                self._train_tf.set_random_state(np.random.default_rng(seed), random.Random(seed))
                out = self._train_tf(image=image)["image"]
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))).unsqueeze(1)  # (C, 1, R, R)

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, aug_seed = _parse_key(key, len(self))
        for k in range(len(self)):
            j = (index + k) % len(self)
            if j in self._bad:
                continue
            try:
                image = self._load(self.files[j])
            except Exception as e:  # noqa: BLE001 - e.g. a truncated file that passed verify()
                self._bad.add(j)
                self._skip(self.files[j], e)
                continue
            return self._transform(image, aug_seed), int(self.labels[j])
        raise RuntimeError(f"none of the {len(self)} images under {self.root} could be decoded")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # locks do not pickle (DataLoader workers with spawn)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class SyntheticDataset(KeyedDataset):
    """Random data without files, for benchmarks: item ``i`` is uniform in ``[-1, 1]`` drawn from a
    ``torch.Generator`` seeded from ``(seed, i)``, shape ``(channels, num_frames, R, R)``, with label
    ``i % num_classes``. ``aug_seed`` is ignored.

    Raises
    ------
    ValueError
        If ``size``, ``num_classes`` or a shape is not positive, or ``seed`` is negative.
    """

    def __init__(self, size: int, channels: int, num_frames: int, resolution: int, num_classes: int, seed: int = 0):
        if min(size, channels, num_frames, resolution, num_classes) < 1 or seed < 0:
            raise ValueError("synthetic data needs positive size/channels/num_frames/resolution/num_classes "
                             f"and seed >= 0, got {(size, channels, num_frames, resolution, num_classes, seed)}")
        self.shape, self.seed = (channels, num_frames, resolution, resolution), int(seed)
        self.labels = np.arange(size, dtype=np.int64) % num_classes
        self.classes = [str(c) for c in range(num_classes)]

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, _ = _parse_key(key, len(self))
        g = torch.Generator().manual_seed(sample_seed(self.seed, index))
        return torch.rand(self.shape, generator=g) * 2 - 1, int(self.labels[index])


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
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.holdout_fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    held = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_hold = min(max(round(fraction * len(members)), 1), len(members) - 1) if fraction > 0 else 0
        if fraction > 0 and n_hold == 0:
            warnings.warn(f"class {c} has a single item: it has no held-out item", stacklevel=2)
        held.append(members[:n_hold])
    heldout = np.sort(np.concatenate(held)).astype(np.int64)
    return np.setdiff1d(np.arange(len(labels)), heldout).astype(np.int64), heldout


def build_datasets(cfg: DataConfig, seed: int) -> Tuple[KeyedSubset, KeyedSubset]:
    """Build the training and held-out datasets of ``cfg``.

    Parameters
    ----------
    cfg : DataConfig
        ``cfg.name`` is one of ``"digits"``, ``"image_folder"``, ``"synthetic"``, ``"video_folder"``
        (clip windows of videos; training windows overlapping held-out windows are dropped, see
        :meth:`vitp.data.video.VideoFolderDataset.disjoint_train`).
    seed : int
        Fixes the held-out split (and the synthetic data).

    Returns
    -------
    train, heldout : KeyedSubset
        Disjoint subsets of one dataset; ``heldout`` always uses the eval transform. Items are
        ``(x, label)`` with ``x`` float32 ``(C, T, H, W)`` in ``[-1, 1]``.

    Raises
    ------
    ValueError
        Unknown ``cfg.name``; ``data.root`` unset for image_folder (``root`` and ``files`` for
        video_folder); ``num_frames != 1`` for images; no usable video;
        ``cfg.num_classes`` differing from the classes found; a bad ``holdout_fraction``.
    FileNotFoundError
        If ``data.root`` does not exist.
    """
    if cfg.name == "digits":
        base: KeyedDataset = DigitsDataset(cfg.resolution, cfg.channels)
    elif cfg.name == "image_folder":
        if cfg.root is None:
            raise ValueError("data.name=image_folder needs data.root=<folder with one subfolder of images per class>")
        base = ImageFolderDataset(cfg.root, cfg.resolution, cfg.channels, train=True,
                                  random_crop=cfg.random_crop, hflip=cfg.hflip)
    elif cfg.name == "synthetic":
        base = SyntheticDataset(cfg.synthetic_size, cfg.channels, cfg.num_frames, cfg.resolution,
                                cfg.num_classes, seed)
    elif cfg.name == "video_folder":
        from vitp.data.video import VideoFolderDataset

        if cfg.root is None and not cfg.files:
            raise ValueError("data.name=video_folder needs data.root=<folder with one subfolder of videos per "
                             "class> or data.files=[<video>, ...]")
        base = VideoFolderDataset(cfg.root, cfg.resolution, cfg.num_frames, frame_stride=cfg.frame_stride,
                                  fps=cfg.fps, clip_step=cfg.clip_step, channels=cfg.channels, train=True,
                                  random_crop=cfg.random_crop, hflip=cfg.hflip,
                                  files=None if cfg.files is None else list(cfg.files),
                                  class_per_file=cfg.class_per_file, cache_dir=cfg.cache_dir,
                                  video_cache_mb=cfg.video_cache_mb)
    else:
        raise ValueError(f"unknown data.name={cfg.name!r}; valid names: {', '.join(DATASET_NAMES)}")
    if cfg.name not in ("synthetic", "video_folder") and cfg.num_frames != 1:
        raise ValueError(f"data.name={cfg.name} holds still images: set data.num_frames=1 (got {cfg.num_frames})")
    if base.num_classes != cfg.num_classes:
        where = f" under {cfg.root}" if cfg.name in ("image_folder", "video_folder") and cfg.root else ""
        shown = ", ".join(base.classes[:10]) + (", ..." if base.num_classes > 10 else "")
        raise ValueError(f"found {base.num_classes} classes{where} ({shown}) but data.num_classes="
                         f"{cfg.num_classes}; set data.num_classes={base.num_classes}")
    train_idx, held_idx = stratified_split(base.labels, cfg.holdout_fraction, seed)
    if cfg.name == "video_folder":  # no training clip may share frames with a held-out clip
        train_idx = base.disjoint_train(train_idx, held_idx)
    return KeyedSubset(base, train_idx), KeyedSubset(base, held_idx, eval_only=True)
