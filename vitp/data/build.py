"""The dataset named by a :class:`~vitp.config.DataConfig`, split into training and held-out subsets."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from vitp.config import DataConfig
from vitp.data.base import KeyedDataset, KeyedSubset, stratified_split
from vitp.data.images import DigitsDataset, ImageFolderDataset, SyntheticDataset
from vitp.data.photos import resolve_photo_root
from vitp.data.shards import shard_datasets
from vitp.data.text import CAPTION_SOURCES, item_captions, text_embeddings_pending
from vitp.data.video import VideoFolderDataset

__all__ = ["DATASET_NAMES", "build_datasets", "check_data_paths", "dataset_captions", "ensure_text_embeddings", "stratified_split"]

log = logging.getLogger(__name__)

DATASET_NAMES = ("digits", "image_folder", "shards", "synthetic", "video_folder")


def check_data_paths(cfg: Any) -> None:
    """The cheap part of :func:`build_datasets`' checks, for a ``data`` config section: the folders
    it reads are set and exist (``data.root`` of an image or video folder, ``data.heldout_root``, a
    local ``data.shards``), so that a missing folder is named before the layout planner's memory
    check (which would otherwise refuse the run for a size the data never had).

    Raises ``ValueError`` for an unset ``data.root`` or a ``data.heldout_root`` that is ``data.root``
    (the held-out set would be the training set); ``FileNotFoundError`` / ``NotADirectoryError``
    naming the key for a folder that does not exist or is a file."""
    from pathlib import Path

    from vitp.data.photos import PHOTOS_ROOT

    what = {"image_folder": "one subfolder of images per class", "video_folder": "one subfolder of videos per class"}
    folders = []
    if cfg.name in what:
        if cfg.root is None and not (cfg.name == "video_folder" and cfg.files):
            raise ValueError(f"data.name={cfg.name} needs data.root=<folder with {what[cfg.name]}>")
        if cfg.root is not None and cfg.root != PHOTOS_ROOT:
            folders.append(("data.root", cfg.root, what[cfg.name]))
        if cfg.heldout_root is not None:
            folders.append(("data.heldout_root", cfg.heldout_root, what[cfg.name]))
    if cfg.name == "shards" and cfg.shards and "://" not in str(cfg.shards):
        folders.append(("data.shards", cfg.shards, "the folder vitp-pack wrote"))
    for key, folder, holds in folders:
        path = Path(str(folder)).expanduser()
        if path.is_file():
            raise NotADirectoryError(f"{key}={folder} is a file, not a folder; set {key}=<folder with {holds}>")
        if not path.is_dir():
            raise FileNotFoundError(f"{key}={folder} does not exist; set {key}=<folder with {holds}>")
    if len(folders) == 2 and folders[1][0] == "data.heldout_root" and \
            Path(str(folders[0][1])).expanduser().resolve() == Path(str(folders[1][1])).expanduser().resolve():
        raise ValueError(f"data.heldout_root={cfg.heldout_root} is data.root: the held-out loss and FID would score "
                         f"the items the run trains on; set data.heldout_root=<another folder with {what[cfg.name]}>, "
                         f"or data.heldout_root=null to hold out data.holdout_fraction of data.root")


def _base_dataset(cfg: DataConfig, seed: int) -> KeyedDataset:
    """The whole dataset ``cfg.name``, built from the fields of ``cfg`` as plain arguments."""
    if cfg.name == "digits":
        return DigitsDataset(cfg.resolution, cfg.channels)
    if cfg.name == "image_folder":
        if cfg.root is None:
            raise ValueError("data.name=image_folder needs data.root=<folder with one subfolder of images per class>")
        return ImageFolderDataset(resolve_photo_root(cfg.root), cfg.resolution, cfg.channels, train=True,
                                  random_crop=cfg.random_crop, hflip=cfg.hflip)
    if cfg.name == "synthetic":  # with data.latent_channels: random latents of the model's input shape
        from vitp.config import input_channels, input_frames, input_size

        comp = list(getattr(cfg, "vae_compression", None) or [1, 1])
        return SyntheticDataset(cfg.synthetic_size, input_channels(cfg.channels, getattr(cfg, "latent_channels", 0)),
                                input_frames(cfg.num_frames, comp), input_size(cfg.resolution, comp),
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
                                  video_cache_mb=cfg.video_cache_mb, scene_cut_threshold=cfg.scene_cut_threshold,
                                  class_per_shot=cfg.class_per_shot)
    raise ValueError(f"unknown data.name={cfg.name!r}; valid names: {', '.join(DATASET_NAMES)}")


def build_datasets(cfg: DataConfig, seed: int, keep: Optional[Callable[[Any, np.ndarray], np.ndarray]] = None,
                   split: Optional[Any] = None) -> Tuple[KeyedSubset, KeyedSubset]:
    """Build the training and held-out datasets of ``cfg``.

    Parameters
    ----------
    cfg : DataConfig
        ``cfg.name`` is one of ``"digits"``, ``"image_folder"``, ``"synthetic"``, ``"video_folder"``
        (clip windows of videos, held out by file or file tail:
        :meth:`vitp.data.video.VideoFolderDataset.heldout_items`; training windows overlapping
        held-out windows are dropped, see :meth:`vitp.data.video.VideoFolderDataset.disjoint_train`), ``"shards"`` (a data set
        packed by ``vitp-pack``, split as its manifest says: :func:`vitp.data.shards.shard_datasets`).
    seed : int
        Fixes the held-out split (and the synthetic data).
    keep : callable, optional
        ``keep(base, items)`` -> bool mask: only these items of the base dataset (a shape bucket's,
        :func:`vitp.data.buckets.in_bucket`); a packed data set applies it while it splits, so no
        item list of the whole data set is made for a bucket.
    split : dict or path, optional
        A run's held-out split record (:data:`vitp.data.heldout_record.RECORD_NAME` in its folder),
        as :func:`vitp.data.heldout_record.read_record` gives it, or its path (read with
        ``cfg.num_frames``: with ``data.buckets``, whose ``cfg`` has a bucket's frame count, pass
        the record read with the run's ``data.num_frames``); None, or a path with no file: none.
        An image or video folder split by ``holdout_fraction`` keeps it at ``cfg.num_frames``
        (:func:`vitp.data.heldout_record.keep_recorded`: recorded held-out items stay held out, items
        of recorded files stay in training, new files are split by the rule).

    Returns
    -------
    train, heldout : KeyedSubset
        Disjoint subsets of one dataset, or with ``cfg.heldout_root`` all of ``cfg.root`` and all of
        that folder; ``heldout`` always uses the eval transform. Items are
        ``(x, label)`` with ``x`` float32 ``(C, T, H, W)`` in ``[-1, 1]``. A folder split by
        ``holdout_fraction`` gives ``heldout.split_items`` (:class:`vitp.data.base.KeyedSubset`):
        the held-out item indices of ``heldout.base`` before captions and ``keep`` drop any
        (sorted int64; what the run's record holds, :func:`vitp.data.heldout_record.record_split`).

    Raises
    ------
    ValueError
        Unknown ``cfg.name``; ``data.root`` unset for image_folder (``root`` and ``files`` for
        video_folder); ``num_frames != 1`` for images; no usable video;
        ``cfg.num_classes`` differing from the classes found; a bad ``holdout_fraction``;
        ``heldout_root`` with other classes than ``root``, or for digits / synthetic data; a
        damaged ``split`` record; no training item left (every one overlaps a held-out clip).
    FileNotFoundError
        If ``data.root`` (or ``data.heldout_root``) does not exist.
    """
    if cfg.name == "shards":  # the split is the manifest's (vitp-pack)
        return shard_datasets(cfg, keep)
    from vitp.data.heldout_record import read_record

    record = split if isinstance(split, dict) else read_record(split, cfg.num_frames)
    train, held = _folder_datasets(cfg, seed, record)
    if keep is None:  # the whole data set's split (a bucket's part of it would say the same again)
        note = heldout_share_note(cfg, len(train), len(held))
        if note:
            log.warning(note)
        return train, held
    # a bucket's part keeps the whole split (every bucket's share): what the record holds
    return tuple(KeyedSubset(s.base, s.indices[keep(s.base, s.indices)], eval_only=s.eval_only,
                             split_items=s.split_items) for s in (train, held))


def _folder_datasets(cfg: DataConfig, seed: int, record: Optional[dict] = None) -> Tuple[KeyedSubset, KeyedSubset]:
    """:func:`build_datasets` of data that is not packed (folders, digits, synthetic); ``record``:
    the run's recorded split (:mod:`vitp.data.heldout_record`)."""
    base = _base_dataset(cfg, seed)
    if cfg.name not in ("synthetic", "video_folder") and cfg.num_frames != 1:
        raise ValueError(f"data.name={cfg.name} holds still images: set data.num_frames=1 (got {cfg.num_frames})")
    if base.num_classes != cfg.num_classes:
        where = f" under {cfg.root}" if cfg.name in ("image_folder", "video_folder") and cfg.root else ""
        shown = ", ".join(base.classes[:10]) + (", ..." if base.num_classes > 10 else "")
        dropped = getattr(base, "dropped_classes", [])
        if dropped:  # class folders whose every video was skipped (too short or unreadable)
            shown += f"; dropped, no usable video: {', '.join(dropped[:10])}" + (", ..." if len(dropped) > 10 else "")
        raise ValueError(f"found {base.num_classes} classes{where} ({shown}) but data.num_classes="
                         f"{cfg.num_classes}; set data.num_classes={base.num_classes}")
    if cfg.heldout_root is not None:
        held = _heldout_folder(cfg, base, seed)
        return (KeyedSubset(base, _captioned(base, cfg, np.arange(len(base)))),
                KeyedSubset(held, _captioned(held, cfg, np.arange(len(held))), eval_only=True))
    if cfg.name == "video_folder":  # whole files or a file's last windows; no training clip shares their frames
        held_idx = base.heldout_items(cfg.holdout_fraction, seed)
    else:
        train_idx, held_idx = stratified_split(base.labels, cfg.holdout_fraction, seed)
    if record is not None and cfg.name in ("image_folder", "video_folder"):  # the split the run started with
        from vitp.data.heldout_record import keep_recorded

        held_idx = keep_recorded(base, held_idx, record, f"data folder {cfg.root or 'data.files'}", cfg.num_frames)
        train_idx = np.setdiff1d(np.arange(len(base)), held_idx)
    if cfg.name == "video_folder":
        train_idx = base.disjoint_train(np.setdiff1d(np.arange(len(base)), held_idx), held_idx)
        if len(held_idx) and not len(train_idx):
            raise ValueError(_no_training_window(cfg, base, held_idx))
    train_kept, held_kept = _captioned(base, cfg, train_idx), _captioned(base, cfg, held_idx, read=False)
    if len(held_idx) and not len(held_kept):  # the split came first: said, or eval.json lacks its loss unexplained
        log.warning("none of the %d held-out item(s) has a caption (data.captions=%s): the run has no held-out loss; "
                    "caption them, or raise data.holdout_fraction", len(held_idx), cfg.captions)
    split = np.asarray(held_idx, dtype=np.int64) if cfg.name in ("image_folder", "video_folder") else None
    return KeyedSubset(base, train_kept), KeyedSubset(base, held_kept, eval_only=True, split_items=split)


def heldout_share_note(cfg: DataConfig, n_train: int, n_held: int) -> Optional[str]:
    """A warning when a folder's held-out share is well above ``data.holdout_fraction`` (at least
    twice it and 5 points more), else None. A small folder gets there: whole video files and at
    least one item per class are held out, whatever the fraction (a new user's 2 classes x 2 files
    held out 40 % at 0.02)."""
    total, fraction = n_train + n_held, cfg.holdout_fraction
    if cfg.name not in ("image_folder", "video_folder") or cfg.heldout_root or not n_held or not fraction:
        return None
    share = n_held / total
    if share < max(2 * fraction, fraction + 0.05):
        return None
    unit = ("whole video files, at least one per class (a class of one file: its last clip windows)"
            if cfg.name == "video_folder" else "at least one image per class")
    more = "video files" if cfg.name == "video_folder" else "images"
    return (f"the held-out split is {n_held} of {total} items ({100 * share:.0f} %), well above "
            f"data.holdout_fraction={fraction:g}: a folder holds out {unit}. Add {more} to each class, or "
            f"hold out a separate folder with data.heldout_root=DIR")


def _no_training_window(cfg: DataConfig, base: Any, held_idx: np.ndarray) -> str:
    """Why a video folder's split left no training clip window, and the fixes."""
    return (f"the training set is empty: the {len(held_idx)} held-out clip(s) overlap every training window "
            f"({len(base)} window(s) of {len(base.files)} usable file(s) with data.clip_step={cfg.clip_step}, "
            f"data.num_frames={cfg.num_frames}; training clips may share no frame with held-out ones). Raise "
            f"data.clip_step (at least one clip's span of frames), lower data.holdout_fraction (now "
            f"{cfg.holdout_fraction}; 0 holds out nothing), add video files, or hold out a separate folder "
            f"with data.heldout_root=<folder>")


def _captioned(base: KeyedDataset, cfg: DataConfig, indices: np.ndarray, read: bool = True) -> np.ndarray:
    """``indices`` without the items that have no caption (``data.captions`` set; the captions
    are read into ``base.captions`` once, :func:`vitp.data.text.item_captions`)."""
    if cfg.captions is None:
        return indices
    if read or getattr(base, "captions", None) is None:
        base.captions = item_captions(base, cfg)
    keep = np.array([c is not None for c in base.captions], dtype=bool)
    return indices[keep[indices]]


def _with_root(cfg, root: str):
    """``cfg`` (a :class:`DataConfig` or its ``DictConfig``) reading the folder ``root`` whole
    (``data.files`` names files of ``data.root``, so it is dropped)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.merge(cfg, {"root": root, "files": None})
    return replace(cfg, root=root, files=None)


def _heldout_folder(cfg: DataConfig, train: KeyedDataset, seed: int) -> KeyedDataset:
    """The whole of ``cfg.heldout_root`` as the held-out set (e.g. a SageMaker ``validation``
    channel), read like ``cfg.root``. Its classes must be the training classes, so that a label
    means the same class in both; a folder without class subfolders is one class either way."""
    if cfg.name not in ("image_folder", "video_folder"):
        raise ValueError(f"data.heldout_root is for data.name=image_folder or video_folder, not {cfg.name}; "
                         f"unset it (data.holdout_fraction splits the data instead)")
    held = _base_dataset(_with_root(cfg, cfg.heldout_root), seed)
    same = held.classes == train.classes or held.num_classes == train.num_classes == 1
    if not same:
        raise ValueError(f"data.heldout_root={cfg.heldout_root} has classes {', '.join(held.classes[:10])} but "
                         f"data.root has {', '.join(train.classes[:10])}; give both folders the same class "
                         f"subfolders")
    return held


def dataset_captions(data_cfg: Any, seed: int = 0) -> List[str]:
    """Every caption of the data set ``data_cfg`` describes (training and held-out items, in
    item order, duplicates kept): what ``vitp-encode-captions`` encodes.

    Raises ``ValueError`` when ``data.captions`` is unset, and what building the data raises.
    """
    if data_cfg.captions is None:
        raise ValueError(f"data.captions is unset: choose where captions come from ({CAPTION_SOURCES}), or give "
                         "vitp-encode-captions --captions FILE")
    train, held = build_datasets(data_cfg, seed)
    return [c for ds in (train, held) for c in ds.captions]


def ensure_text_embeddings(cfg: Any) -> bool:
    """Encode the data set's captions into ``data.text_embeddings`` (what ``vitp-encode-captions``
    does, on the training device) when a text-conditional run names its encoder
    (``data.text_encoder``) and no store is there yet, so that a demo trains in one command.
    Returns whether it encoded. Call it on one process and let the others wait."""
    from vitp.text import TextEncoder, write_store

    d, m = cfg.data, cfg.model
    if not text_embeddings_pending(cfg):
        return False
    enc = TextEncoder(d.text_encoder, device="auto", max_length=m.text_len or None)
    captions = dataset_captions(d, cfg.seed)
    log.info(f"encoding {len(captions)} captions with the text encoder {enc.record['name']} into {d.text_embeddings} "
             "(vitp-encode-captions does this ahead of training)")
    write_store(d.text_embeddings, captions, enc, progress=False)
    return True
