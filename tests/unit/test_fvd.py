"""FVD from feature sums (vitp.eval.fvd): the sums of a split equal one process's, the distance
cd-fvd's own FVD of the same clips; short clips are repeated to I3D's 9 frames; the real
statistics are cached and refused for other weights, data or feature extraction; the clips'
``.npz`` is layout-free; wrong weights and image runs are refused.

Random-weight I3D (scripts/make_random_eval_weights.py), 8x8 clips (resized to 224 as cd-fvd
does); each clip costs about 0.8 s of one CPU here, so the counts are tiny (3 clips a side: the
covariances have rank 2 of 400).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

SMALL = ["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_frames=4", "data.resolution=8",
         "model.tubelet_size=2"]


def _script():
    from tests.helpers import eval_weights_script

    return eval_weights_script()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A random-weight I3D file as ``scripts/make_random_eval_weights.py OUT`` writes ``OUT/i3d.pt``."""
    return _script().random_i3d(tmp_path_factory.mktemp("fvdw") / "i3d.pt")


def _clips(n, seed, frames=9):
    """``(n, frames, 8, 8, 3)`` uint8: random frames drifting in colour over time."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n, 1, 8, 8, 3), generator=g).float()
    drift = torch.linspace(0, 1, frames).view(1, frames, 1, 1, 1) * torch.randint(-60, 60, (n, 1, 1, 1, 3), generator=g)
    return (base + drift).clamp(0, 255).to(torch.uint8)


def _close(a, b, rel):
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


def test_split_sums_equal_one_process_and_cd_fvd(weights):
    """Each replica's sums (2 and 4 replicas, other batch sizes) add up to one process's to 1e-6;
    the FVD equals cd-fvd's ``compute_fvd`` of the same clips (its own network, preprocessing and
    ``scipy.linalg.sqrtm``) to 1e-4. The distance of a split is 1e-6 from one process's when the
    forwards are the same (one clip each), and compared at 1e-5 with batches of other sizes: those
    change the float32 features by ~3e-7, and the 398 zero eigenvalues of these rank-2 covariances
    turn that into ~1.5e-6 of the distance."""
    from cdfvd.fvd import cdfvd

    from vitp.eval.fid import FeatureSums, image_sums
    from vitp.eval.fvd import FVD, frechet_video, i3d
    from vitp.eval.inference import Share

    real, fake = _clips(3, 0), _clips(3, 1)
    net = i3d(str(weights))
    r1, f1 = (image_sums(net, c, range(3), 3, metric=FVD) for c in (real, fake))

    def split(k, batch, twice=()):  # the replicas' sums of the generated clips, added as Share.sum adds them
        total = FeatureSums.zeros(400)
        for r in [*range(k), *twice]:
            s = image_sums(net, fake, Share(r, k).indices(3), batch, metric=FVD)
            total = FeatureSums(total.n + s.n, total.s + s.s, total.ss + s.ss)
        return total

    one = frechet_video(r1, f1)
    for k, batch in ((2, 1), (4, 2)):  # at 4 replicas the last one holds no clip
        got = split(k, batch)
        assert got.n == f1.n == 3 and _close(got.s, f1.s, 1e-6) and _close(got.ss, f1.ss, 1e-6)
        assert frechet_video(r1, got) == pytest.approx(one, rel=1e-5)
    one_b1 = frechet_video(r1, image_sums(net, fake, range(3), 1, metric=FVD))  # one clip per forward, as split(k, 1)
    for k in (2, 4):  # the same forwards split over replicas: only the float64 sums' order differs
        assert frechet_video(r1, split(k, 1)) == pytest.approx(one_b1, rel=1e-6)
    lib = cdfvd("i3d", ckpt_path=str(weights), device="cpu", n_real="full", n_fake="full")
    ref = lib.compute_fvd(real.numpy(), fake.numpy())
    assert _close(torch.from_numpy(lib.real_stats.raw_cov), r1.ss, 1e-6)  # the library's own sums
    assert one > 1 and one == pytest.approx(float(ref), rel=1e-4)
    bad = split(2, 1, twice=(1,))  # a fault: one replica's clips counted twice
    assert bad.n == 4 and abs(frechet_video(r1, bad) / one - 1) > 1e-2


def test_short_clips_are_repeated_and_images_refused():
    from vitp.eval.fvd import MIN_FRAMES, fit_frames, to_clips

    clips = _clips(2, 3, frames=4)
    got = fit_frames(clips)  # 4 frames: each 3 times (12 >= 9), in order
    assert got.shape == (2, 12, 8, 8, 3) and torch.equal(got[:, 3 * 2 + 1], clips[:, 2])
    assert torch.equal(got, clips.repeat_interleave(3, dim=1))
    for t in (MIN_FRAMES, 16):  # long enough: kept
        c = _clips(1, 4, frames=t)
        assert fit_frames(c) is c
    assert fit_frames(_clips(1, 5, frames=2)).shape[1] == 10
    with pytest.raises(ValueError, match="at least 2 frames, got 1"):
        fit_frames(_clips(1, 6, frames=1))
    x = torch.tensor([-1.0, 1.0]).view(1, 1, 2, 1, 1).expand(1, 1, 2, 2, 2)  # 1 channel, 2 frames
    c = to_clips(x)
    assert c.shape == (1, 2, 2, 2, 3) and c.dtype == torch.uint8 and c[0, 0].max() == 0 and c[0, 1].min() == 255
    with pytest.raises(ValueError, match="1- or 3-channel videos, got 4"):
        to_clips(torch.zeros(1, 4, 2, 2, 2))


class _Counted:
    """Video items ``(x (3, 4, 8, 8) in [-1, 1], label)``, counting the reads."""

    def __init__(self, n):
        self.x, self.reads = _clips(n, 7, frames=4).permute(0, 4, 1, 2, 3).float() / 127.5 - 1, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, key):
        self.reads += 1
        return self.x[key[0]], 0


def test_real_statistics_are_cached_and_refused_for_other_weights_data_or_features(weights, tmp_path):
    from vitp.config import compose
    from vitp.eval.fid import file_digest, real_statistics
    from vitp.eval.fvd import FVD, i3d
    from vitp.eval.inference import Share

    cfg, ds, net = compose([*SMALL, "eval.fvd.batch_size=2"]), _Counted(2), i3d(str(weights))
    cache, digest = tmp_path / "real.safetensors", file_digest(weights)
    first = real_statistics(net, cfg, ds, 2, Share(), cache, digest, FVD)  # 4-frame clips: repeated to 12
    assert ds.reads == 2 and first.n == 2 and first.s.shape == (400,) and float(first.ss.diagonal().min()) > 0
    again = real_statistics(net, cfg, ds, 2, Share(), cache, digest, FVD)
    assert ds.reads == 2 and torch.equal(again.ss, first.ss)  # read from the cache: no item read
    with pytest.raises(ValueError, match=f"{cache} holds the FVD real statistics of other I3D weights "
                                         r"\(eval.fvd.weights\).* eval.fvd.real_stats=ANOTHER_FILE"):
        real_statistics(net, cfg, ds, 2, Share(), cache, "0" * 64, FVD)
    with pytest.raises(ValueError, match="other feature extraction"):
        real_statistics(net, cfg, ds, 2, Share(), cache, digest, dataclasses.replace(FVD, protocol="another"))
    for other in ([cfg, 1], [compose([*SMALL, "seed=1"]), 2]):  # fewer items; another split
        with pytest.raises(ValueError, match="other data or split .* delete it to recompute"):
            real_statistics(net, other[0], ds, other[1], Share(), cache, digest, FVD)
    with pytest.raises(ValueError, match="holds the FID real statistics of other Inception weights"):
        real_statistics(net, cfg, ds, 2, Share(), cache, digest)  # FID's cache is not FVD's
    assert ds.reads == 2


def test_bad_weights_files_and_image_runs_are_refused(weights, tmp_path):
    from vitp.config import check_fields, compose
    from vitp.eval.fvd import check_fvd, check_weights

    with pytest.raises(ValueError, match="needs eval.fvd.weights=FILE: .*i3d_pretrained_400.pt"):
        check_weights(None)
    with pytest.raises(FileNotFoundError, match=f"eval.fvd.weights={tmp_path / 'no.pt'}: no such file"):
        check_weights(str(tmp_path / "no.pt"))
    torch.save({"logits.conv3d.weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"is not cd-fvd's I3D \(logits.conv3d.weight \(2,\)"):
        check_weights(str(tmp_path / "other.pt"))
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="is not a PyTorch state dict"):
        check_weights(str(tmp_path / "text.pt"))
    video = compose([*SMALL, "eval.fvd.num=2", f"eval.fvd.weights={weights}"])
    assert check_fvd(video) == weights
    with pytest.raises(ValueError, match="eval.fvd.num=2: FVD scores videos, but this run makes images"):
        check_fvd(compose(["experiment=smoke", "eval.fvd.num=2", f"eval.fvd.weights={weights}"]))
    with pytest.raises(ValueError, match="eval.fvd.num=1: must be 0 .off. or an integer >= 2"):
        check_fields(compose([*SMALL, "eval.fvd.num=1"]))


class _Gen:
    """A stand-in denoiser ``tanh(3 z)``."""

    def __call__(self, z, t, *y):
        return torch.tanh(3 * z)


def test_fvd_clips_npz_is_the_same_in_any_blocks(tmp_path):
    from vitp.config import compose
    from vitp.eval.fid import fid_labels, npz_images, write_fid_samples
    from vitp.eval.fvd import FVD
    from vitp.eval.inference import Share

    files = []
    for block, batch in ((2, 3), (5, 2)):
        cfg = compose([*SMALL, "eval.fvd.num=5", f"eval.fvd.block={block}", f"sampler.batch_size={batch}",
                       "sampler.cfg_scale=1", "sampler.steps=2"])
        labels = fid_labels(cfg, None, torch.zeros(1, dtype=torch.long), cfg.eval.fvd.num)
        files.append(tmp_path / f"b{block}.fvd.npz")
        write_fid_samples(_Gen(), cfg, labels, Share(), files[-1], metric=FVD)
        assert not files[-1].with_name(files[-1].name + ".parts").exists()
    assert labels.tolist() == [0, 1, 2, 3, 4]  # class-balanced (smoke: 10 classes)
    assert files[0].read_bytes() == files[1].read_bytes()
    clips = np.asarray(npz_images(files[0], FVD.item_dims))
    assert clips.shape == (5, 4, 8, 8, 3) and clips.dtype == np.uint8 and len({c.tobytes() for c in clips}) == 5
    with pytest.raises(ValueError, match=r"FID reads uint8 \(N, H, W, 3\) images"):
        npz_images(files[0])


def test_small_counts_are_said_with_both_numbers(tmp_path, caplog):
    """A new user's FID of 6 real and 8 generated items (2048-d features) and ``eval.fvd.real_num=50``
    clamped to the 2 clips there were gave numbers with nothing said: the real side's clamp names
    both numbers, and a side with fewer items than features says the number is not comparable with
    published ones."""
    import logging

    from vitp.config import compose
    from vitp.eval.fid import FID, real_side, warn_small_counts
    from vitp.eval.fvd import FVD
    from vitp.eval.inference import Share

    cfg = compose(["experiment=smoke", "eval.fvd.real_num=50", "eval.fvd.real=heldout"])
    with caplog.at_level(logging.WARNING, logger="vitp"):
        ds, count, cache = real_side(cfg, FVD, list(range(9)), [0, 1], tmp_path, Share())
        fid_line = warn_small_counts(FID, 6, 8)
        assert warn_small_counts(FVD, 400, 2048) is None and warn_small_counts(FID, 2048, 50000) is None
        fvd_line = warn_small_counts(FVD, 2, 4)
    assert (count, cache.name) == (2, "fvd_real_heldout2.safetensors")
    assert fid_line == ("FID from 6 real and 8 generated images, fewer than its 2048 features: this FID is not comparable "
                        "with published FIDs (made at 50,000 samples (FID-50K)); compare it only with FIDs of the same "
                        "counts")
    assert fvd_line.startswith("FVD from 2 real and 4 generated clips, fewer than its 400 features: this FVD is not "
                               "comparable with published FVDs (made at 2,048 clips)")
    assert [r.getMessage() for r in caplog.records] == [
        "eval.fvd.real_num=50 but the heldout set has 2 items: the FVD real side uses 2 (recorded as fvd_real_items)",
        fid_line, fvd_line]
