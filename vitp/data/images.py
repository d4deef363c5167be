"""Image datasets: the scikit-learn digits, folders of photos, and synthetic (file-less) data.

Items follow :class:`vitp.data.base.KeyedDataset`: ``(x, label)`` with ``x`` float32
``(C, T, H, W)`` in ``[-1, 1]`` (``T = 1`` for images, any ``T`` for synthetic data).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from vitp.config import parse_resolution
from vitp.data.base import FileDataset, Key, KeyedDataset, error_text, files_by_class, parse_key
from vitp.objectives.flow import sample_seed

IMAGE_EXTENSIONS = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # Pillow's modes of 16-bit grey (PNG, ...)


def load_image(path: Union[str, Path], channels: int = 3, draft: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """Decode an image file as a viewer shows it.

    - EXIF orientation applied (``ImageOps.exif_transpose``): a phone photo stored sideways with
      ``Orientation=6`` comes out upright, its height and width swapped;
    - every bit depth scaled to the full range: 16-bit grey (Pillow modes ``I;16*``, and ``I``,
      taken as 0..65535) keeps its precision as float32 (``v * 255 / 65535``), since Pillow's own
      ``convert`` clips such values to 255; 1-bit, palette, CMYK and 8-bit modes go through
      ``Image.convert``; 16-bit RGB(A) PNGs are read by Pillow at 8 bits (the high byte);
    - transparency (alpha channel, or a PNG/GIF transparent colour) composited over white, as
      img2dataset does, instead of showing whatever colour the transparent pixels hold.

    Parameters
    ----------
    path : str or Path
    channels : int
        3 (RGB) or 1 (grey; ITU-R 601-2 luma for colour sources).
    draft : (int, int), optional
        JPEG only: decode at the smallest DCT scale (1/2, 1/4, 1/8) that keeps both sides at least
        this size, in pixels (``Image.draft``); the whole file is still read and checked.

    Returns
    -------
    np.ndarray
        ``(H, W, channels)`` in displayed orientation: uint8 (0..255) for 8-bit sources, float32
        in ``[0, 255]`` for deeper ones.

    Raises
    ------
    Exception
        Whatever Pillow raises for an unreadable file (``UnidentifiedImageError``, ``OSError`` for a
        truncated one, ...).
    """
    mode = "RGB" if channels == 3 else "L"
    with Image.open(path) as im:
        if draft is not None:
            im.draft(mode, draft)
        im = ImageOps.exif_transpose(im)  # a new, fully decoded image
    if im.mode in _DEEP_MODES:
        arr = np.clip(np.asarray(im, dtype=np.float32), 0, 65535)[..., None] * np.float32(255 / 65535)
        return np.repeat(arr, channels, axis=2)
    if im.has_transparency_data:
        im = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im)
    arr = np.asarray(im.convert(mode))
    return arr if arr.ndim == 3 else arr[..., None]


def check_image(path: Path, channels: int) -> Optional[str]:
    """``None`` when ``path`` decodes, else the reason ("<type>: <message>"). The full decode (at
    1/8 scale for JPEG) finds truncated files, which ``Image.verify`` does not."""
    try:
        load_image(path, channels, draft=(1, 1))
    except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
        return error_text(e)
    return None


def digits_tensor(pixels: np.ndarray, resolution: Any) -> torch.Tensor:
    """The digits' pixels ``(N, 8, 8)`` (0..16) as items: ``pixels / 8 - 1``, bilinearly resized
    (``align_corners=False``) to ``M x M``, ``M = max(H, W)``, when ``M != 8``, then center-cropped to
    ``(H, W)``. Returns float32 ``(N, 1, 1, H, W)``."""
    x = torch.from_numpy(np.asarray(pixels).astype(np.float32) / 8.0 - 1.0).unsqueeze(1)  # (N, 1, 8, 8)
    H, W = parse_resolution(resolution)
    m = max(H, W)
    if m != 8:
        x = F.interpolate(x, size=(m, m), mode="bilinear", align_corners=False)
    top, left = (m - H) // 2, (m - W) // 2  # center crop (as albumentations' CenterCrop)
    return x[..., top:top + H, left:left + W].unsqueeze(2).contiguous()  # (N, C=1, T=1, H, W)


def load_digits() -> Tuple[np.ndarray, np.ndarray]:
    """``(images (1797, 8, 8) float64 in 0..16, target (1797,) int)``: the data of
    ``sklearn.datasets.load_digits`` (the UCI optical digits test set), equal to it.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, 64 pixel columns
    and the class) without importing scikit-learn: ``sklearn.datasets`` takes 1 to 1.5 s to import,
    a third of a training rank's start-up on the digits. Falls back to ``load_digits`` when the
    file is not where this scikit-learn keeps it.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sk_load_digits

        d = sk_load_digits()
        return d.images, d.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


class DigitsDataset(KeyedDataset):
    """The 1797 real 8x8 handwritten digits of ``sklearn.datasets.load_digits`` (10 classes).

    ``x = pixels / 8 - 1`` (pixels are 0..16), shape ``(1, 1, H, W)``: bilinearly resized
    (``align_corners=False``) to ``M x M``, ``M = max(H, W)``, when ``M != 8``, then center-cropped to
    ``(H, W)`` (aspect preserved). No augmentation: ``aug_seed`` is ignored.

    Raises
    ------
    ValueError
        If ``channels != 1`` (the digits are grayscale).
    """

    def __init__(self, resolution: Any = 8, channels: int = 1):
        if channels != 1:
            raise ValueError(f"the digits are grayscale: set data.channels=1 (got {channels})")
        images, target = load_digits()
        self.images = digits_tensor(images, resolution)
        self.labels = target.astype(np.int64)
        self.classes = [str(c) for c in range(10)]

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, _ = parse_key(key, len(self))
        return self.images[index].clone(), int(self.labels[index])


class ImageFolderDataset(FileDataset):
    """Photos in a folder: the class is the immediate subfolder name (sorted); files are found
    recursively under each class folder. Images lying directly in ``root`` with no subfolders form
    a single class named after ``root``.

    Transform (albumentations, see :class:`~vitp.data.base.FileDataset`): the aspect-preserving
    resize that covers ``(H, W)`` (``SmallestMaxSize``, area interpolation when shrinking), then
    ``RandomCrop`` (train and ``random_crop``) or ``CenterCrop`` to ``(H, W)``, ``HorizontalFlip(p=0.5)`` (train and ``hflip``), then scaling to ``[-1, 1]``.
    ``aug_seed=None`` always gives center crop without flip.

    Pixels are read as a viewer shows them (EXIF orientation, every bit depth, transparency over
    white: see :func:`load_image`); 16-bit sources keep their precision (float32 through the transform).

    Every file is decoded once when the index is built (in threads; JPEG at 1/8 scale): files that
    fail (unreadable, truncated) are skipped with a warning naming the file and the reason, listed
    in ``skipped_files`` and counted in ``num_skipped`` before training starts. A file that still
    fails to decode in ``__getitem__`` (e.g. changed on disk since) is warned about once and
    replaced by the next decodable index (cyclically), so the output stays deterministic
    (per process: DataLoader workers keep their own list).

    Parameters
    ----------
    root : str or Path
    resolution : int, (H, W) or "HxW"
        Output size in pixels (an int: square).
    channels : int
        3 (RGB) or 1 (grayscale). Output ``x`` has shape ``(channels, 1, H, W)``.
    train : bool
        Whether an int ``aug_seed`` applies the random crop / flip.
    random_crop, hflip : bool

    Raises
    ------
    FileNotFoundError
        If ``root`` is not an existing directory.
    ValueError
        If ``channels`` is not 1 or 3, or ``root`` holds no readable image.
    vitp.data.base.UnreadableData
        From ``__getitem__``, when no image decodes.
    """

    kind, skip_label = "image", "unreadable image"

    def __init__(self, root: Union[str, Path], resolution: Any, channels: int = 3, train: bool = True,
                 random_crop: bool = True, hflip: bool = True):
        self.root = Path(root).expanduser()
        super().__init__(resolution, channels, train)
        if self.channels not in (1, 3):
            raise ValueError(f"image_folder supports data.channels=3 (RGB) or 1 (grayscale), got {channels}")
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"image folder {str(self.root)!r} does not exist or is not a directory; "
                f"set data.root=<folder with one subfolder of images per class>")
        self._scan()
        self._make_transforms(random_crop, hflip, pre=[self.cover_resize()])

    def _scan(self) -> None:
        groups = files_by_class(self.root, IMAGE_EXTENSIONS, "image")
        found = [(path, label) for label, name in enumerate(groups) for path in groups[name]]
        # Pillow decodes without the GIL: threads make the decode-check of a large folder affordable
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            reasons = list(pool.map(lambda pl: check_image(pl[0], self.channels), found))
        files, labels = [], []
        for (path, label), reason in zip(found, reasons):
            if reason is not None:
                self._skip(path, reason)
                continue
            files.append(path)
            labels.append(label)
        if not files:
            raise ValueError(
                f"no readable image under {str(self.root)!r} (skipped {self.num_skipped} unreadable); accepted "
                f"extensions (case-insensitive): {', '.join(IMAGE_EXTENSIONS)}. Put images in <root>/<class>/ "
                f"subfolders, or directly in <root> for a single class")
        self.files, self.labels, self.classes = files, np.asarray(labels, dtype=np.int64), list(groups)

    def _file_of(self, index: int) -> int:
        return index  # one image per item

    def native_size(self, index: int) -> Tuple[int, int]:
        """``(h, w)`` of item ``index`` as a viewer shows it (EXIF orientation applied), from the
        file header (for :func:`vitp.data.buckets.assign`)."""
        with Image.open(self.files[index]) as im:
            w, h = im.size
            turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # orientations that swap the sides
        return (w, h) if turned else (h, w)

    def _read(self, index: int, aug_seed: Optional[int]) -> np.ndarray:
        """Decode to ``(H, W, channels)``, uint8 or float32 in ``[0, 255]`` (:func:`load_image`)."""
        r = max(self.size)  # JPEG: decode at a reduced size whose sides stay >= max(H, W), enough to cover
        return load_image(self.files[index], self.channels, draft=(r, r))

    def _to_tensor(self, out: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))).unsqueeze(1)  # (C, 1, H, W)

    def _undecodable(self, bad: Sequence[int], why: str = "") -> str:
        return (f"none of the {len(self.files)} images under {self.root} could be decoded ({self._example(bad, why)}): "
                f"they changed since the start-up scan; replace or remove the damaged files and start again")


class SyntheticDataset(KeyedDataset):
    """Random data without files, for benchmarks: item ``i`` is uniform in ``[-1, 1]`` drawn from a
    ``torch.Generator`` seeded from ``(seed, i)``, shape ``(channels, num_frames, R, R)``, with label
    ``i % num_classes``; ``resolution`` is an int (square), ``(H, W)`` or ``"HxW"``. ``aug_seed`` is ignored.

    Raises
    ------
    ValueError
        If ``size``, ``num_classes`` or a shape is not positive, or ``seed`` is negative.
    """

    def __init__(self, size: int, channels: int, num_frames: int, resolution: Any, num_classes: int, seed: int = 0):
        H, W = parse_resolution(resolution)
        if min(size, channels, num_frames, H, W, num_classes) < 1 or seed < 0:
            raise ValueError("synthetic data needs positive size/channels/num_frames/resolution/num_classes "
                             f"and seed >= 0, got {(size, channels, num_frames, (H, W), num_classes, seed)}")
        self.shape, self.seed = (channels, num_frames, H, W), int(seed)
        self.labels = np.arange(size, dtype=np.int64) % num_classes
        self.classes = [str(c) for c in range(num_classes)]

    def __getitem__(self, key: Key) -> Tuple[torch.Tensor, int]:
        index, _ = parse_key(key, len(self))
        g = torch.Generator().manual_seed(sample_seed(self.seed, index))
        return torch.rand(self.shape, generator=g) * 2 - 1, int(self.labels[index])
