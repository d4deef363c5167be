"""Tests of vitp.data: digits, image folders of real photos (shipped with scikit-image), synthetic data."""
import logging
import os
import pickle

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitp.config import DataConfig
from vitp.data import (
    DigitsDataset,
    ImageFolderDataset,
    KeyedDataset,
    SyntheticDataset,
    build_datasets,
)
from vitp.data.images import load_image

R = 32


def _check_item(item, shape):
    x, y = item
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == shape
    assert x.min() >= -1 and x.max() <= 1
    assert isinstance(y, int)


def _save(array, path, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return path


def _dir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def photo_root(tmp_path_factory):
    """Two classes of real photos in PNG / JPEG / WebP / BMP, one in a nested folder, one upper-case suffix."""
    root = tmp_path_factory.mktemp("photos")
    _save(skimage.data.chelsea(), root / "cats" / "chelsea.png")
    _save(skimage.data.cat(), root / "cats" / "nested" / "cat.JPG", format="JPEG", quality=90)
    _save(skimage.data.astronaut(), root / "things" / "astronaut.webp")
    _save(skimage.data.coffee(), root / "things" / "coffee.jpeg", quality=90)
    _save(skimage.data.rocket(), root / "things" / "rocket.bmp")
    return root


def _cfg(**kw):
    return DataConfig(**kw)


# ----------------------------------------------------------------------------------------- digits
def test_digits_split_is_stratified_and_fixed_by_seed():
    train, held = build_datasets(_cfg(name="digits", holdout_fraction=0.2), seed=0)
    assert len(train) + len(held) == 1797 and len(held) == 359
    assert set(train.indices).isdisjoint(held.indices)
    assert sorted(np.concatenate([train.indices, held.indices])) == list(range(1797))
    assert set(held.labels.tolist()) == set(range(10)) == set(train.labels.tolist())
    counts = np.bincount(held.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # ~20% of each class (174..183 items)
    assert train.classes == held.classes == [str(c) for c in range(10)]
    assert train.labels.dtype == np.int64 and isinstance(train.base, KeyedDataset)
    again, _ = build_datasets(_cfg(name="digits"), seed=0)
    other, _ = build_datasets(_cfg(name="digits"), seed=1)
    assert np.array_equal(train.indices, again.indices) and not np.array_equal(train.indices, other.indices)


def test_digits_items_and_resize():
    ds = DigitsDataset()
    assert len(ds) == 1797 and ds.num_classes == 10
    _check_item(ds[(5, None)], (1, 1, 8, 8))
    assert torch.equal(ds[(5, None)][0], ds[(5, 123)][0])  # no augmentation on digits
    x = torch.stack([ds[(i, None)][0] for i in range(50)])
    assert x.min() == -1 and x.max() == 1  # pixels 0..16 -> /8 - 1
    assert ds[(0, None)][1] == 0 and ds[(1, None)][1] == 1
    big = DigitsDataset(resolution=16)
    _check_item(big[(5, 3)], (1, 1, 16, 16))
    with pytest.raises(ValueError, match="data.channels=1"):
        DigitsDataset(channels=3)
    with pytest.raises(IndexError):
        ds[(1797, None)]


def test_heldout_fraction_zero_and_invalid():
    train, held = build_datasets(_cfg(name="digits", holdout_fraction=0.0), seed=0)
    assert len(train) == 1797 and len(held) == 0
    with pytest.raises(ValueError, match="holdout_fraction"):
        build_datasets(_cfg(name="digits", holdout_fraction=1.0), seed=0)


def test_bad_config_messages():
    with pytest.raises(ValueError, match="digits, image_folder, shards, synthetic"):
        build_datasets(_cfg(name="mnist"), seed=0)
    with pytest.raises(ValueError, match="data.root="):
        build_datasets(_cfg(name="image_folder", root=None), seed=0)
    with pytest.raises(ValueError, match="data.num_frames=1"):
        build_datasets(_cfg(name="digits", num_frames=4), seed=0)
    with pytest.raises(ValueError, match="set data.num_classes=10"):
        build_datasets(_cfg(name="digits", num_classes=7), seed=0)


# ----------------------------------------------------------------------------------- image folder
def test_image_folder_classes_shapes_range(photo_root):
    ds = ImageFolderDataset(photo_root, R, channels=3)
    assert ds.classes == ["cats", "things"] and ds.labels.tolist() == [0, 0, 1, 1, 1]
    assert ds.num_skipped == 0
    for i in range(len(ds)):
        _check_item(ds[(i, None)], (3, 1, R, R))
        _check_item(ds[(i, 10 + i)], (3, 1, R, R))
    x = torch.stack([ds[(i, None)][0] for i in range(len(ds))])
    assert x.min() < -0.8 and x.max() > 0.8  # real photos use the whole range
    gray = ImageFolderDataset(photo_root, R, channels=1)
    _check_item(gray[(0, 7)], (1, 1, R, R))


def test_image_folder_augmentation_is_a_function_of_the_seed(photo_root):
    ds = ImageFolderDataset(photo_root, R, channels=3, train=True)
    keys = [(i, s) for i in range(len(ds)) for s in (0, 1, 2**40, -5)]
    first = [ds[k][0] for k in keys]
    for k, x in zip(reversed(keys), reversed(first)):  # other order, same results
        assert torch.equal(ds[k][0], x)
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert all(torch.equal(clone[k][0], x) for k, x in zip(keys, first))
    loader = DataLoader(ds, batch_size=None, sampler=keys, num_workers=2)
    assert all(torch.equal(x, y) for (x, _), y in zip(loader, first))
    # coffee.jpeg (index 3) is 400x600: different seeds give different crops / flips
    crops = {ds[(3, s)][0].numpy().tobytes() for s in range(8)}
    assert len(crops) > 4


def test_crop_offset_and_flip_are_independent(tmp_path):
    # 64x32 portrait: channel 0 grows left -> right (shows flips), channel 1 grows top -> bottom (crop offset)
    img = np.zeros((64, 32, 3), np.uint8)
    img[..., 0] = np.arange(32)[None, :] * 8
    img[..., 1] = np.arange(64)[:, None] * 4
    _save(img, tmp_path / "p" / "portrait.png")
    ds = ImageFolderDataset(tmp_path / "p", 32, train=True)
    combos = set()
    for s in range(40):
        x = ds[(0, s)][0][:, 0]
        combos.add((bool(x[0, 0, 0] > x[0, 0, -1]), bool(x[1, 0, 0] < -0.5)))  # (flipped, offset < 16)
    assert len(combos) == 4


def test_image_folder_flip_only_and_eval_is_center_crop(photo_root, tmp_path):
    flip_only = ImageFolderDataset(photo_root, R, train=True, random_crop=False, hflip=True)
    center = flip_only[(4, None)][0]
    outs = [flip_only[(4, s)][0] for s in range(20)]
    assert all(torch.equal(x, center) or torch.equal(x, center.flip(-1)) for x in outs)
    assert any(torch.equal(x, center) for x in outs) and any(torch.equal(x, center.flip(-1)) for x in outs)
    fixed = ImageFolderDataset(photo_root, R, train=True, random_crop=False, hflip=False)
    assert torch.equal(fixed[(4, 99)][0], center)
    # a 30x90 image of red | green | blue bands: the center crop is all green
    bands = np.zeros((30, 90, 3), np.uint8)
    bands[:, :30, 0] = bands[:, 30:60, 1] = bands[:, 60:, 2] = 255
    _save(bands, tmp_path / "bands" / "bands.png")
    x, _ = ImageFolderDataset(tmp_path / "bands", 10, train=False)[(0, None)]
    assert torch.allclose(x[:, 0], torch.tensor([-1.0, 1.0, -1.0]).view(3, 1, 1).expand(3, 10, 10))


def test_heldout_split_uses_eval_transform(photo_root):
    train, held = build_datasets(
        _cfg(name="image_folder", root=str(photo_root), resolution=R, channels=3, num_classes=2,
             holdout_fraction=0.3), seed=0)
    assert len(held) == 2 and sorted(held.labels.tolist()) == [0, 1] and len(train) == 3
    base = held.base
    for i in range(len(held)):
        expected = base[(int(held.indices[i]), None)][0]
        assert torch.equal(held[(i, 1)][0], expected) and torch.equal(held[(i, 2)][0], expected)
    crops = {train[(2, s)][0].numpy().tobytes() for s in range(6)}
    assert len(crops) > 1  # the training subset augments


def test_heldout_root_is_the_whole_held_out_set(photo_root, tmp_path):
    """data.heldout_root (a SageMaker validation channel): all of root trains, all of that folder is
    held out with the eval transform and the same labels; other classes, or digits, are refused."""
    val = tmp_path / "validation"
    _save(skimage.data.coffee(), val / "things" / "coffee.png")
    _save(skimage.data.chelsea(), val / "cats" / "chelsea.png")
    cfg = dict(name="image_folder", root=str(photo_root), resolution=R, channels=3, num_classes=2)
    train, held = build_datasets(_cfg(**cfg, heldout_root=str(val)), seed=0)
    assert len(train) == 5 and held.classes == train.classes == ["cats", "things"]
    assert held.labels.tolist() == [0, 1] and held.base.root == val
    assert torch.equal(held[(0, 7)][0], held.base[(0, None)][0])  # eval transform
    _save(skimage.data.rocket(), val / "rockets" / "rocket.png")
    with pytest.raises(ValueError, match="has classes cats, rockets, things but data.root has cats, things"):
        build_datasets(_cfg(**cfg, heldout_root=str(val)), seed=0)
    with pytest.raises(ValueError, match="data.heldout_root is for data.name=image_folder or video_folder"):
        build_datasets(_cfg(name="digits", heldout_root=str(val)), seed=0)


def test_single_class_folder(tmp_path):
    root = tmp_path / "only_photos"
    _save(skimage.data.coffee(), root / "coffee.png")
    _save(skimage.data.chelsea(), root / "chelsea.webp")
    ds = ImageFolderDataset(root, R, channels=3)
    assert ds.classes == ["only_photos"] and len(ds) == 2 and ds.labels.tolist() == [0, 0]
    train, held = build_datasets(_cfg(name="image_folder", root=str(root), resolution=R, channels=3,
                                      num_classes=1, holdout_fraction=0.5), seed=0)
    assert len(train) == 1 and len(held) == 1


def _noise(h=40, w=48, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_unreadable_files_are_skipped_and_counted(tmp_path, caplog):
    root = tmp_path / "mixed"
    good = _save(_noise(seed=1), root / "a" / "good.png")
    _save(_noise(seed=2), root / "b" / "noise.png")
    (root / "a" / "bad.jpg").write_bytes(np.random.default_rng(0).bytes(2000))
    png = (root / "a" / "good.png").read_bytes()
    (root / "a" / "truncated.png").write_bytes(png[: len(png) // 2])
    jpg = _save(_noise(seed=3), root / "b" / "astro.jpg", quality=90).read_bytes()
    (root / "b" / "astro.jpg").write_bytes(jpg[: len(jpg) // 2])  # passes Image.verify(), fails to decode
    (root / "b" / "notes.txt").write_text("not an image")
    caplog.set_level(logging.WARNING, logger="vitp.data")
    ds = ImageFolderDataset(root, R, channels=3)
    messages = caplog.text
    assert "bad.jpg" in messages and "truncated.png" in messages
    assert "astro.jpg: OSError: image file is truncated" in messages
    assert ds.num_skipped == 3
    assert {os.path.basename(f) for f in ds.skipped_files} == {"bad.jpg", "truncated.png", "astro.jpg"}
    assert [f.name for f in ds.files] == ["good.png", "noise.png"]
    # a file damaged after the scan fails in __getitem__: warned once, counted, replaced by the next index
    good.write_bytes(png[: len(png) // 2])
    caplog.clear()
    x, y = ds[(0, 5)]
    assert "good.png" in caplog.text and len(caplog.records) == 1
    assert torch.equal(x, ds[(1, 5)][0]) and y == 1 and ds.num_skipped == 4
    assert torch.equal(ds[(0, 5)][0], x) and len(caplog.records) == 1  # same answer, no second warning


def test_truncated_jpeg_is_skipped_at_scan(tmp_path, caplog):
    root = tmp_path / "photos"
    for i in range(3):
        _save(_noise(seed=i), root / f"good{i}.jpg", quality=90)
    jpg = _save(_noise(seed=9), root / "cut.jpg", quality=90).read_bytes()
    (root / "cut.jpg").write_bytes(jpg[: len(jpg) * 3 // 4])
    caplog.set_level(logging.WARNING, logger="vitp.data")
    train, held = build_datasets(_cfg(name="image_folder", root=str(root), resolution=R, channels=3,
                                      num_classes=1, holdout_fraction=0.0), seed=0)
    assert "cut.jpg: OSError: image file is truncated" in caplog.text
    ds = train.base  # what the trainer logs as "skipped 1 unreadable file(s)"
    assert ds.num_skipped == 1 and len(ds) == 3 and len(train) == 3 and ds.skip_summary() == "1 unreadable file(s)"
    assert [f.name for f in ds.files] == ["good0.jpg", "good1.jpg", "good2.jpg"]
    caplog.clear()
    for i in range(len(train)):  # training-time reads never meet the truncated file
        for s in (None, 1, 2):
            _check_item(train[(i, s)], (3, 1, R, R))
    assert not caplog.records
    assert ds.num_skipped == 1


def test_exif_orientation_is_applied(tmp_path):
    # stored 16 x 32 (H x W), white in its top-left 8 x 16 corner; Orientation=6 means "rotate 90
    # degrees clockwise to display", so a viewer shows 32 x 16 with white in the top-right 16 x 8
    stored = np.zeros((16, 32, 3), np.uint8)
    stored[:8, :16] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    path = _save(stored, tmp_path / "phone" / "sideways.jpg", quality=95, exif=exif)
    shown = load_image(path, 3)
    assert shown.shape == (32, 16, 3)
    assert shown[:16, 8:].min() > 240 and shown[16:].max() < 15 and shown[:, :8].max() < 15
    ds = ImageFolderDataset(tmp_path / "phone", 16, channels=3, train=False)
    assert ds.num_skipped == 0
    x = ds[(0, None)][0][:, 0]  # center crop: displayed rows 8..23, so white is the top-right 8 x 8
    assert x[:, :8, 8:].min() > 0.9
    assert x[:, 8:].max() < -0.9 and x[:, :, :8].max() < -0.9


def test_16_bit_grey_is_scaled_not_clipped(tmp_path):
    root = tmp_path / "deep"
    values = {0: -1.0, 32768: 32768 / 65535 * 2 - 1, 65535: 1.0}
    for v in values:
        _save(np.full((12, 10), v, np.uint16), root / f"v{v:05d}.png")  # Pillow writes mode I;16 as 16-bit PNG
    assert Image.open(root / "v32768.png").mode == "I;16"
    for channels in (1, 3):
        ds = ImageFolderDataset(root, 8, channels=channels, train=False)
        got = [ds[(i, None)][0] for i in range(len(ds))]
        for x, want in zip(got, values.values()):
            assert tuple(x.shape) == (channels, 1, 8, 8)
            assert torch.allclose(x, torch.full_like(x, want), atol=1e-5), (channels, want, x.flatten()[0])


def test_bilevel_palette_and_transparency(tmp_path):
    root = tmp_path / "modes"
    half = np.zeros((8, 8), bool)
    half[:, :4] = True
    Image.fromarray(half).save(_dir(root) / "a_bilevel.png")  # mode "1": left white
    pal = Image.fromarray(np.where(half, 1, 2).astype(np.uint8), mode="P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255])
    pal.save(root / "b_palette.png")  # left red, right blue
    pal.save(root / "c_palette_transparent.png", transparency=1)  # left transparent -> white
    la = np.zeros((8, 8, 2), np.uint8)
    la[:, 4:, 1] = 255  # black everywhere; only the right half opaque
    Image.fromarray(la, mode="LA").save(root / "d_la.png")
    ds = ImageFolderDataset(root, 8, channels=3, train=False)
    assert ds.num_skipped == 0 and len(ds) == 4
    white, black, red, blue = (1, 1, 1), (-1, -1, -1), (1, -1, -1), (-1, -1, 1)
    want = [(white, black), (red, blue), (white, blue), (white, black)]  # (left half, right half)
    for i, (left, right) in enumerate(want):
        x = ds[(i, None)][0][:, 0]
        assert torch.equal(x[:, :, :4], torch.tensor(left, dtype=torch.float32).view(3, 1, 1).expand(3, 8, 4)), i
        assert torch.equal(x[:, :, 4:], torch.tensor(right, dtype=torch.float32).view(3, 1, 1).expand(3, 8, 4)), i


def test_missing_and_empty_roots(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.*data.root="):
        ImageFolderDataset(tmp_path / "nope", R)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"empty.*\.jpg.*\.webp"):
        ImageFolderDataset(tmp_path / "empty", R)
    with pytest.raises(ValueError, match="data.channels=3"):
        ImageFolderDataset(tmp_path / "empty", R, channels=2)


def test_num_classes_mismatch_message(photo_root):
    cfg = _cfg(name="image_folder", root=str(photo_root), resolution=R, channels=3, num_classes=10)
    with pytest.raises(ValueError, match=r"found 2 classes.*cats, things.*set data.num_classes=2"):
        build_datasets(cfg, seed=0)


# -------------------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic():
    ds = SyntheticDataset(size=20, channels=3, num_frames=4, resolution=8, num_classes=5, seed=3)
    _check_item(ds[(7, None)], (3, 4, 8, 8))
    assert ds.labels.tolist() == [i % 5 for i in range(20)] and ds.classes == ["0", "1", "2", "3", "4"]
    same = SyntheticDataset(size=20, channels=3, num_frames=4, resolution=8, num_classes=5, seed=3)
    other = SyntheticDataset(size=20, channels=3, num_frames=4, resolution=8, num_classes=5, seed=4)
    assert torch.equal(ds[(7, None)][0], same[(7, 1)][0])
    assert not torch.equal(ds[(7, None)][0], ds[(8, None)][0])
    assert not torch.equal(ds[(7, None)][0], other[(7, None)][0])
    train, held = build_datasets(_cfg(name="synthetic", synthetic_size=100, channels=3, num_frames=2,
                                      resolution=4, num_classes=4, holdout_fraction=0.2), seed=0)
    assert len(train) == 80 and len(held) == 20 and np.bincount(held.labels).tolist() == [5, 5, 5, 5]
    _check_item(train[(0, 0)], (3, 2, 4, 4))


def test_digits_read_without_scikit_learn_equal_load_digits(monkeypatch):
    """The digits read from scikit-learn's file (no ``sklearn`` import, its 1 s off a rank's
    start-up) equal ``sklearn.datasets.load_digits``; without the file, ``load_digits`` itself."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    from vitp.data import images

    want = sk_load_digits()
    got = images.load_digits()
    assert got[0].dtype == want.images.dtype and np.array_equal(got[0], want.images)
    assert np.array_equal(got[1], want.target)
    code = "import sys; from vitp.data.images import DigitsDataset; DigitsDataset(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    monkeypatch.setattr(images.Path, "is_file", lambda self: False)  # another layout of scikit-learn
    fallback = images.load_digits()
    assert np.array_equal(fallback[0], want.images) and np.array_equal(fallback[1], want.target)
