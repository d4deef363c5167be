"""A small real-photo folder made from the photographs that ship inside scikit-image (no download).

``skimage.data`` holds a few colour photographs in the installed package: ``astronaut`` (512x512,
NASA portrait of Eileen Collins), ``chelsea`` (300x451, a cat), ``coffee`` (400x600, a cup of
coffee) and ``rocket`` (427x640, a launch). None of them is portrait-shaped, so the folder is made
of crops: item ``i`` of a class is a random crop of its photo with aspect ratio (h / w) ``3/2``
(portrait), ``1`` (square) or ``2/3`` (landscape) in turn, covering 55-100 % of the largest such
crop, flipped left-right half the time, and resized (Lanczos) so that its longer side is
``max_side`` pixels. One subfolder per photo subject (= class), PNG files, so the folder reads as
any ``data.name=image_folder`` root and trains with aspect-ratio buckets (:mod:`vitp.data.buckets`).

``data.root=skimage:photos`` (``data=skimage_photos``) builds it once into the cache directory
(:func:`vitp.data.video.default_cache_dir`); ``python scripts/make_photo_folder.py OUT`` writes it
anywhere.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Sequence

import numpy as np

PHOTOS_ROOT = "skimage:photos"
SUBJECTS: Dict[str, str] = {"astronaut": "astronaut", "cat": "chelsea", "coffee": "coffee", "rocket": "rocket"}
ASPECTS = (1.5, 1.0, 2 / 3)  # h / w: portrait, square, landscape


def _crop(photo: np.ndarray, aspect: float, rng: np.random.Generator) -> np.ndarray:
    """A random crop of ``photo`` ``(H, W, 3)`` with ``h / w = aspect``, 55-100 % of the largest."""
    H, W = photo.shape[:2]
    h_max = min(H, int(W * aspect))
    h = max(8, int(h_max * rng.uniform(0.55, 1.0)))
    w = max(8, min(W, round(h / aspect)))
    y, x = rng.integers(0, H - h + 1), rng.integers(0, W - w + 1)
    out = photo[y:y + h, x:x + w]
    return out[:, ::-1] if rng.random() < 0.5 else out


def make_photo_folder(root: str | Path, classes: Sequence[str] = ("astronaut", "cat", "coffee"),
                      per_class: int = 36, max_side: int = 64, seed: int = 0) -> Path:
    """Write ``root/<class>/<i>.png`` (``per_class`` crops per subject of :data:`SUBJECTS`) and a
    ``photos.json`` with the parameters; a folder that already holds the same parameters is kept.

    Returns ``root``. Raises ``ValueError`` for an unknown subject or ``max_side < 8``.
    """
    import skimage.data
    from PIL import Image

    bad = [c for c in classes if c not in SUBJECTS]
    if bad or max_side < 8:
        raise ValueError(f"subjects {bad} unknown (valid: {', '.join(SUBJECTS)}) or max_side={max_side} < 8")
    root = Path(root).expanduser()
    params = {"classes": list(classes), "per_class": per_class, "max_side": max_side, "seed": seed, "version": 1}
    stamp = root / "photos.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return root
    tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")  # built aside, then renamed: ranks may race
    for c, name in enumerate(classes):
        photo = getattr(skimage.data, SUBJECTS[name])()[..., :3]
        rng = np.random.default_rng([seed, c])
        (tmp / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            crop = Image.fromarray(np.ascontiguousarray(_crop(photo, ASPECTS[i % len(ASPECTS)], rng)))
            s = max_side / max(crop.size)
            crop = crop.resize((max(1, round(crop.width * s)), max(1, round(crop.height * s))), Image.LANCZOS)
            crop.save(tmp / name / f"{i:03d}.png")
    (tmp / "photos.json").write_text(json.dumps(params) + "\n")
    if root.exists() and not (stamp.is_file() and json.loads(stamp.read_text()) == params):
        shutil.rmtree(root)  # other parameters: replaced
    try:
        os.rename(tmp, root)
    except OSError:  # another process got there first with the same folder
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def resolve_photo_root(root: str) -> str:
    """``skimage:photos`` -> the cached folder (made on first use); any other root unchanged."""
    if root != PHOTOS_ROOT:
        return root
    from vitp.data.video import default_cache_dir

    return str(make_photo_folder(default_cache_dir() / "skimage_photos"))
