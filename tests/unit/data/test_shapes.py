"""Non-square outputs: aspect-preserving resize + crop (no squashing) for photos, video frames,
digits and synthetic data."""
import numpy as np
import pytest
import torch
from PIL import Image

from vitp.data import DigitsDataset, ImageFolderDataset, SyntheticDataset


def _ramp(h, w):
    """uint8 RGB image whose value is its column index (a horizontal ramp)."""
    return np.repeat(np.repeat(np.arange(w, dtype=np.uint8)[None, :, None], h, 0), 3, 2)


@pytest.mark.parametrize("size,shape", [((60, 120), (30, 20)), ((120, 60), (30, 20)), ((60, 120), (20, 30))])
def test_photo_is_resized_to_cover_then_cropped(tmp_path, size, shape):
    """A column ramp keeps its slope: the scale is max(H / h, W / w) on both axes, so a landscape
    and a portrait photo both come out as (H, W) with their aspect kept, center-cropped."""
    (h, w), (H, W) = size, shape
    Image.fromarray(_ramp(h, w)).save(tmp_path / "ramp.png")
    ds = ImageFolderDataset(tmp_path, f"{H}x{W}", channels=3, train=False)
    x = ds[(0, None)][0]
    assert tuple(x.shape) == (3, 1, H, W)
    scale = max(H / h, W / w)
    cols = (x[0, 0, 0] + 1) * 127.5  # back to pixel values of row 0
    slope = float((cols[-1] - cols[0]) / (W - 1))
    assert slope == pytest.approx(1 / scale, rel=0.05)  # squashing to (H, W) would give w / W
    assert float(cols.mean()) == pytest.approx((w - 1) / 2, abs=1 / scale)  # centered


def test_random_crop_of_a_non_square_target(tmp_path):
    Image.fromarray(_ramp(50, 90)).save(tmp_path / "ramp.png")
    ds = ImageFolderDataset(tmp_path, [16, 24], channels=3, train=True, hflip=False)
    xs = {float(ds[(0, s)][0][0, 0, 0, 0]) for s in range(8)}
    assert ds[(0, 1)][0].shape == (3, 1, 16, 24) and len(xs) > 1  # the crop offset varies with the seed


def test_digits_and_synthetic_non_square():
    d8 = DigitsDataset(8)
    d = DigitsDataset([8, 6])
    assert d[0][0].shape == (1, 1, 8, 6)
    torch.testing.assert_close(d[0][0], d8[0][0][..., 1:7])  # center crop of the 8x8 digit, no resize
    assert DigitsDataset("6x12")[3][0].shape == (1, 1, 6, 12)
    assert SyntheticDataset(4, 3, 2, "10x6", 2)[0][0].shape == (3, 2, 10, 6)
