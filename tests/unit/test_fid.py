"""FID from feature sums (vitp.eval.fid): the sums of a split equal one process's and
torchmetrics' own FID of the same images; the real statistics are cached and refused for other
weights or data; the ADM ``.npz`` is layout-free, deterministic and resumable.

Random-weight Inception (scripts/make_random_eval_weights.py), 8x8 images (the library resizes
them to 299); each Inception forward costs about 0.5 s of one CPU here, so the counts are tiny.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch


def _script():
    from tests.helpers import eval_weights_script

    return eval_weights_script()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """``python scripts/make_random_eval_weights.py OUT`` (docs/evaluation.md): ``OUT/inception.pth``."""
    out = tmp_path_factory.mktemp("fidw")
    _script().main([str(out)])
    return out / "inception.pth"


def _images(n, seed):
    return torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_split_sums_equal_one_process_and_torchmetrics(weights):
    from torchmetrics.image.fid import FrechetInceptionDistance

    from vitp.eval.fid import FeatureSums, frechet, inception

    real, fake = _images(5, 0), _images(5, 1)
    net = inception(str(weights))
    with torch.no_grad():
        fr, ff = net(real.permute(0, 3, 1, 2)), net(fake.permute(0, 3, 1, 2))

    def split(f, parts):  # each replica's sums, added as Share.sum adds them
        total = FeatureSums.zeros()
        for rows in parts:
            s = FeatureSums.zeros()
            s.add(f[rows])
            total = FeatureSums(total.n + s.n, total.s + s.s, total.ss + s.ss)
        return total

    one, ff1 = split(fr, [slice(0, 5)]), split(ff, [slice(0, 5)])
    parts = {2: [slice(0, 3), slice(3, 5)], 4: [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]}
    for k, rows in parts.items():  # the sums the replicas add equal one process's: so does their FID
        got = split(fr, rows)
        assert got.n == one.n and torch.allclose(got.s, one.s, rtol=1e-12) and torch.allclose(got.ss, one.ss, rtol=1e-12)
    lib = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=str(weights), antialias=False)
    lib.update(real.permute(0, 3, 1, 2), real=True)
    lib.update(fake.permute(0, 3, 1, 2), real=False)
    assert torch.allclose(lib.real_features_cov_sum, one.ss, rtol=1e-6)  # the library's own statistics
    got, ref = frechet(one, ff1), float(lib.compute())  # 2048 x 2048 eigenvalues: ~15 s each here
    assert got > 1e-3 and got == pytest.approx(ref, rel=1e-4)
    twice = split(fr, [slice(0, 3), slice(3, 5), slice(3, 5)])  # a fault: one replica counted twice
    assert twice.n != one.n and not torch.allclose(twice.mean_cov()[1], one.mean_cov()[1], rtol=1e-2)


class _Counted:
    """Digits-like items ``(x (1, 1, 8, 8) in [-1, 1], label)``, counting the reads."""

    def __init__(self, n):
        self.x, self.reads = _images(n, 2)[..., :1].permute(0, 3, 1, 2)[:, :, None].float() / 127.5 - 1, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, key):
        self.reads += 1
        return self.x[key[0]], 0


def test_real_statistics_are_cached_and_refused_for_other_weights_or_data(weights, tmp_path):
    from vitp.config import compose
    from vitp.eval.fid import file_digest, inception, real_statistics
    from vitp.eval.inference import Share

    cfg, ds, net = compose(["experiment=smoke", "eval.fid.batch_size=2"]), _Counted(3), inception(str(weights))
    cache, digest = tmp_path / "real.safetensors", file_digest(weights)
    first = real_statistics(net, cfg, ds, 3, Share(), cache, digest)
    assert ds.reads == 3 and first.n == 3
    again = real_statistics(net, cfg, ds, 3, Share(), cache, digest)
    assert ds.reads == 3 and torch.equal(again.ss, first.ss)  # read from the cache: no item read
    with pytest.raises(ValueError, match=f"{cache} holds the FID real statistics of other Inception weights"):
        real_statistics(net, cfg, ds, 3, Share(), cache, "0" * 64)
    for other in ([cfg, 2], [compose(["experiment=smoke", "seed=1"]), 3]):  # fewer items; another split
        with pytest.raises(ValueError, match="other data or split .* delete it to recompute"):
            real_statistics(net, other[0], ds, other[1], Share(), cache, digest)
    assert ds.reads == 3
    # at launch (check_real_cache): the file given as FVD's cache, or with another Inception file
    from vitp.eval.fid import check_real_cache

    given = compose(["experiment=smoke", f"eval.fid.real_stats={cache}", f"eval.fvd.real_stats={cache}",
                     f"eval.fid.weights={weights}", f"eval.fvd.weights={weights}"])
    check_real_cache(given, "fid")
    with pytest.raises(ValueError, match=rf"eval.fvd.real_stats={cache} holds the FID real statistics, not FVD's; "
                                         r"delete it"):
        check_real_cache(given, "fvd")
    other_weights = tmp_path / "other.pth"
    other_weights.write_bytes(weights.read_bytes() + b"x")
    given.eval.fid.weights = str(other_weights)
    with pytest.raises(ValueError, match=r"holds the FID real statistics of other weights than eval.fid.weights="):
        check_real_cache(given, "fid")


def test_bad_weights_files_are_refused(tmp_path):
    from vitp.eval.fid import check_weights

    with pytest.raises(ValueError, match="needs eval.fid.weights=FILE"):
        check_weights(None)
    with pytest.raises(FileNotFoundError, match=f"eval.fid.weights={tmp_path / 'no.pth'}: no such file"):
        check_weights(str(tmp_path / "no.pth"))
    torch.save({"w": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="is not torch-fidelity's Inception-V3"):
        check_weights(str(tmp_path / "other.pth"))
    (tmp_path / "text.pth").write_text("hello")
    with pytest.raises(ValueError, match="is not a PyTorch state dict"):
        check_weights(str(tmp_path / "text.pth"))


class _Gen:
    """A stand-in denoiser ``tanh(z)`` that stops (raises) at its ``stop_at``-th call."""

    def __init__(self, stop_at=None):
        self.calls, self.stop_at = 0, stop_at

    def __call__(self, z, t, *y):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return torch.tanh(3 * z)


def test_fid_samples_npz_is_deterministic_and_resumes(tmp_path):
    from vitp.config import compose
    from vitp.eval.fid import fid_labels, npz_images, write_fid_samples
    from vitp.eval.inference import Share

    cfg = compose(["experiment=smoke", "eval.fid.num=10", "eval.fid.block=4", "sampler.batch_size=3",
                   "sampler.cfg_scale=1"])
    labels = fid_labels(cfg, None, torch.zeros(1, dtype=torch.long))
    assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # class-balanced
    first = _Gen()
    write_fid_samples(first, cfg, labels, Share(), tmp_path / "a.npz")
    per = first.calls // 5  # denoiser calls per batch: blocks of 4 in batches of 3 make 5 batches
    other = compose(["experiment=smoke", "eval.fid.num=10", "eval.fid.block=3", "sampler.batch_size=2",
                     "sampler.cfg_scale=1"])
    gen = _Gen(stop_at=2 * per + 1)  # stopped in block 2 (blocks of 3, batches of 2)
    with pytest.raises(KeyboardInterrupt):
        write_fid_samples(gen, other, labels, Share(), tmp_path / "b.npz")
    assert sorted(p.name for p in (tmp_path / "b.npz.parts").iterdir()) == ["block_000000.npy", "meta.json"]
    resumed = _Gen()
    write_fid_samples(resumed, other, labels, Share(), tmp_path / "b.npz")
    assert resumed.calls == per * (2 + 2 + 1)  # blocks 2-4 only: 3 + 3 + 1 samples in batches of 2
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()  # any blocks, batches
    assert not (tmp_path / "b.npz.parts").exists()
    z = np.load(tmp_path / "a.npz")
    assert z["arr_0"].shape == (10, 8, 8, 3) and z["arr_0"].dtype == np.uint8 and z["arr_1"].tolist() == labels.tolist()
    assert np.array_equal(np.asarray(npz_images(tmp_path / "a.npz")), z["arr_0"])
    assert len({z["arr_0"][i].tobytes() for i in range(10)}) == 10


def test_samples_of_other_weights_are_never_reused(tmp_path):
    """A finished ``.npz`` is reused only for the same settings and :func:`sample_source` (the
    weights it was drawn from): another source draws again (a training resumed and trained longer,
    ``vitp-eval --force`` after more training gave the old numbers before); stopped blocks of
    another source are refused by ``vitp-eval`` and replaced by training's own evaluation."""
    from vitp.config import compose
    from vitp.eval.fid import fid_labels, sample_source, write_fid_samples
    from vitp.eval.inference import Share

    cfg = compose(["experiment=smoke", "eval.fid.num=4", "eval.fid.block=2", "sampler.batch_size=2",
                   "sampler.cfg_scale=1"])
    labels, npz = fid_labels(cfg, None, torch.zeros(1, dtype=torch.long)), tmp_path / "s.npz"
    gens = [_Gen() for _ in range(3)]
    with sample_source("weights a"):
        write_fid_samples(gens[0], cfg, labels, Share(), npz)
        write_fid_samples(gens[1], cfg, labels, Share(), npz)  # the same weights: reused
    assert gens[0].calls > 0 and gens[1].calls == 0
    with sample_source("weights b"):
        write_fid_samples(gens[2], cfg, labels, Share(), npz)  # other weights: drawn again
    assert gens[2].calls == gens[0].calls and "weights b" in (tmp_path / "s.npz.json").read_text()
    with sample_source("weights c"), pytest.raises(KeyboardInterrupt):  # stopped after block 1
        write_fid_samples(_Gen(stop_at=gens[0].calls // 2 + 1), cfg, labels, Share(), npz)
    with sample_source("weights d"), pytest.raises(ValueError, match=r"s.npz.parts holds FID samples of other "
                                                                      r"settings .* or other weights; delete it"):
        write_fid_samples(_Gen(), cfg, labels, Share(), npz)
    replaced = _Gen()
    with sample_source("weights d", replace_stale=True):
        write_fid_samples(replaced, cfg, labels, Share(), npz)
    assert replaced.calls == gens[0].calls and not (tmp_path / "s.npz.parts").exists()


def test_fid_against_an_empty_held_out_set_is_refused_before_step_one(weights, tmp_path):
    """``data.holdout_fraction=0`` with ``eval.fid.real=heldout`` (a new user's trial, FVD alike)
    trained to the end, then failed with "raise eval.fvd.num / eval.fvd.real_num" (the wrong fix)
    and left an empty real-statistics cache: now refused when the split is known, before the
    engine and step 1, naming a held-out split and eval.fid.real=train; no file is written."""
    from tests.helpers import compose_cfg
    from vitp.eval.fid import real_statistics
    from vitp.eval.inference import Share
    from vitp.train.trainer import Trainer

    over = ["experiment=smoke", "eval.enabled=true", "data.holdout_fraction=0", "eval.fid.num=4",
            f"eval.fid.weights={weights}", "eval.fid.real=heldout"]
    with pytest.raises(ValueError) as e:
        Trainer(compose_cfg(over), tmp_path / "run")
    assert str(e.value) == ("eval.fid.real=heldout but the run has 0 held-out items (data.holdout_fraction=0), and "
                            "FID needs at least 2 real items: hold out a split with data.holdout_fraction > 0 or "
                            "data.heldout_root=DIR, or score against the training items with eval.fid.real=train")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not list(tmp_path.rglob("*.safetensors"))
    cache = tmp_path / "fid_real_heldoutall.safetensors"  # and never an empty cache, whoever calls it
    with pytest.raises(ValueError, match="^FID needs at least 2 real items, and eval.fid.real=heldout has 0: score"):
        real_statistics(None, compose_cfg(over), [], 0, Share(), cache, "0" * 64)
    assert not cache.exists()
