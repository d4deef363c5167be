"""Datasets keyed by ``(index, aug_seed)`` (images, video clips) and the train / held-out split."""
from vitp.data.datasets import (
    IMAGE_EXTENSIONS,
    DigitsDataset,
    ImageFolderDataset,
    KeyedDataset,
    KeyedSubset,
    SyntheticDataset,
    build_datasets,
    stratified_split,
)
from vitp.data.video import VIDEO_EXTENSIONS, VideoFolderDataset, probe_video


__all__ = [
    "IMAGE_EXTENSIONS",
    "DigitsDataset",
    "ImageFolderDataset",
    "KeyedDataset",
    "KeyedSubset",
    "SyntheticDataset",
    "build_datasets",
    "stratified_split",
    "VIDEO_EXTENSIONS",
    "VideoFolderDataset",
    "probe_video",
]
