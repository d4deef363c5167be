"""Datasets keyed by ``(index, aug_seed)`` (images, video clips) and the train / held-out split.

Layout: :mod:`.base` (keys, :class:`KeyedDataset`, the file-backed base), :mod:`.images`,
:mod:`.video`, :mod:`.build` (config -> split datasets), :mod:`.loader` (batch schedule, collate).
"""
from vitp.data.base import KeyedDataset, KeyedSubset, files_by_class, parse_key
from vitp.data.build import build_datasets, stratified_split
from vitp.data.images import IMAGE_EXTENSIONS, DigitsDataset, ImageFolderDataset, SyntheticDataset
from vitp.data.video import VIDEO_EXTENSIONS, VideoFolderDataset, probe_video

__all__ = [
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "DigitsDataset",
    "ImageFolderDataset",
    "KeyedDataset",
    "KeyedSubset",
    "SyntheticDataset",
    "VideoFolderDataset",
    "build_datasets",
    "files_by_class",
    "parse_key",
    "probe_video",
    "stratified_split",
]
