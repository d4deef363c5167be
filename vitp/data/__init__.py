"""Datasets keyed by ``(index, aug_seed)`` and the train / held-out split."""
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

__all__ = [
    "IMAGE_EXTENSIONS",
    "DigitsDataset",
    "ImageFolderDataset",
    "KeyedDataset",
    "KeyedSubset",
    "SyntheticDataset",
    "build_datasets",
    "stratified_split",
]
