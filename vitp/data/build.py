"""The dataset named by a :class:`~vitp.config.DataConfig`, split into training and held-out subsets."""
from __future__ import annotations

import warnings
from typing import Tuple

import numpy as np

from vitp.config import DataConfig
from vitp.data.base import KeyedDataset, KeyedSubset
from vitp.data.images import DigitsDataset, ImageFolderDataset, SyntheticDataset
from vitp.data.video import VideoFolderDataset

DATASET_NAMES = ("digits", "image_folder", "synthetic", "video_folder")


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


def _base_dataset(cfg: DataConfig, seed: int) -> KeyedDataset:
    """The whole dataset ``cfg.name``, built from the fields of ``cfg`` as plain arguments."""
    if cfg.name == "digits":
        return DigitsDataset(cfg.resolution, cfg.channels)
    if cfg.name == "image_folder":
        if cfg.root is None:
            raise ValueError("data.name=image_folder needs data.root=<folder with one subfolder of images per class>")
        return ImageFolderDataset(cfg.root, cfg.resolution, cfg.channels, train=True,
                                  random_crop=cfg.random_crop, hflip=cfg.hflip)
    if cfg.name == "synthetic":
        return SyntheticDataset(cfg.synthetic_size, cfg.channels, cfg.num_frames, cfg.resolution,
                                cfg.num_classes, seed)
    if cfg.name == "video_folder":
        if cfg.root is None and not cfg.files:
            raise ValueError("data.name=video_folder needs data.root=<folder with one subfolder of videos per "
                             "class> or data.files=[<video>, ...]")
        return VideoFolderDataset(cfg.root, cfg.resolution, cfg.num_frames, frame_stride=cfg.frame_stride,
                                  fps=cfg.fps, clip_step=cfg.clip_step, channels=cfg.channels, train=True,
                                  random_crop=cfg.random_crop, hflip=cfg.hflip,
                                  files=None if cfg.files is None else list(cfg.files),
                                  class_per_file=cfg.class_per_file, cache_dir=cfg.cache_dir,
                                  video_cache_mb=cfg.video_cache_mb)
    raise ValueError(f"unknown data.name={cfg.name!r}; valid names: {', '.join(DATASET_NAMES)}")


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
    base = _base_dataset(cfg, seed)
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
