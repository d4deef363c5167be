"""Tests for vitp.eval.judge: the digits classifier, its cache, and the Frechet distance (FD-digits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import vitp.eval.judge as judge_mod
from vitp.eval.judge import (
    DigitsJudge,
    frechet_distance,
    judge_features,
    judge_metrics,
    load_or_train_judge,
    train_judge,
)


@pytest.fixture(scope="module")
def digits():
    """Real digits as (N, 1, 1, 8, 8) in [-1, 1], stratified 80/20 split with a fixed seed."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None, None] / 8.0 - 1.0
    y = torch.tensor(d.target, dtype=torch.long)
    idx_tr, idx_te = train_test_split(
        np.arange(len(y)), test_size=0.2, stratify=d.target, random_state=0
    )
    idx_tr, idx_te = torch.as_tensor(idx_tr), torch.as_tensor(idx_te)
    return x[idx_tr], y[idx_tr], x[idx_te], y[idx_te]


@pytest.fixture(scope="module")
def judge(digits):
    x_tr, y_tr, _, _ = digits
    return train_judge(x_tr, y_tr, epochs=30, seed=0)


# ----------------------------------------------------------------------------- model


def test_shapes_and_input_ranks():
    torch.manual_seed(0)
    m = DigitsJudge(in_channels=1, num_classes=10, feature_dim=64).eval()
    x5 = torch.rand(3, 1, 1, 8, 8) * 2 - 1
    assert m(x5).shape == (3, 10)
    assert m.features(x5).shape == (3, 64)
    torch.testing.assert_close(m(x5), m(x5[:, :, 0]))
    # adaptive pooling: larger images and other channel counts work too
    m3 = DigitsJudge(in_channels=3, num_classes=7, feature_dim=16)
    assert m3(torch.zeros(2, 3, 1, 16, 16)).shape == (2, 7)
    assert m3.features(torch.zeros(2, 3, 12, 12)).shape == (2, 16)
    with pytest.raises(ValueError, match="T == 1"):
        m(torch.zeros(2, 1, 2, 8, 8))
    with pytest.raises(ValueError, match="B, C, H, W"):
        m(torch.zeros(8, 8))


def test_heldout_accuracy(digits, judge):
    x_tr, y_tr, x_te, y_te = digits
    assert not judge.training
    acc = judge_metrics(judge, x_te, y_te)["accuracy"]
    print(f"held-out accuracy: {acc:.4f} on {len(y_te)} digits")
    assert acc >= 0.93
    # batching does not change the result; 4-D input works too
    assert judge_metrics(judge, x_te[:, :, 0], y_te, batch_size=7)["accuracy"] == acc


def test_judge_metrics_errors(judge):
    with pytest.raises(ValueError, match="labels"):
        judge_metrics(judge, torch.zeros(3, 1, 1, 8, 8), torch.zeros(2, dtype=torch.long))


def test_training_is_deterministic(digits):
    x_tr, y_tr, _, _ = digits
    rng_before = torch.get_rng_state()
    threads_before = torch.get_num_threads()
    a = train_judge(x_tr, y_tr, epochs=2, seed=123)
    b = train_judge(x_tr, y_tr, epochs=2, seed=123)
    c = train_judge(x_tr, y_tr, epochs=2, seed=124)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG state must be untouched"
    assert torch.get_num_threads() == threads_before
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_train_judge_validates_labels(digits):
    x_tr, y_tr, _, _ = digits
    with pytest.raises(ValueError, match="labels must lie"):
        train_judge(x_tr[:4], torch.tensor([0, 1, 2, 10]), epochs=1)
    with pytest.raises(ValueError, match="samples"):
        train_judge(x_tr[:4], y_tr[:3], epochs=1)


# ----------------------------------------------------------------------------- cache


def test_cache_round_trip(digits, tmp_path, monkeypatch):
    x_tr, y_tr, x_te, _ = digits
    path = tmp_path / "sub" / "judge.safetensors"
    first = load_or_train_judge(path, x_tr, y_tr, epochs=1, seed=0)
    assert path.is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["judge.safetensors"], "no tmp files left"

    def _no_training(*args, **kwargs):
        raise AssertionError("second call must load the cache, not train")

    monkeypatch.setattr(judge_mod, "train_judge", _no_training)
    second = load_or_train_judge(str(path), x_tr, y_tr, epochs=1, seed=0)
    assert not second.training
    with torch.no_grad():
        torch.testing.assert_close(first(x_te), second(x_te), rtol=0, atol=0)


def test_corrupt_cache_gives_clear_error(digits, tmp_path):
    x_tr, y_tr, _, _ = digits
    path = tmp_path / "judge.safetensors"
    path.write_bytes(b"this is not a safetensors file")
    with pytest.raises(ValueError, match=r"(?s)judge\.safetensors.*delete it"):
        load_or_train_judge(path, x_tr, y_tr, epochs=1)


def test_wrong_shape_cache_gives_clear_error(digits, tmp_path):
    from safetensors.torch import save_file

    x_tr, y_tr, _, _ = digits
    path = tmp_path / "judge.safetensors"
    save_file({"fc.weight": torch.zeros(3, 3)}, str(path))
    with pytest.raises(ValueError, match=r"(?s)judge\.safetensors.*does not match.*delete it"):
        load_or_train_judge(path, x_tr, y_tr, epochs=1)


# ----------------------------------------------------------------------------- Frechet distance


def _whitened(n: int, d: int, seed: int) -> np.ndarray:
    """(n, d) samples with sample mean exactly 0 and unbiased sample covariance exactly I."""
    z = np.random.default_rng(seed).standard_normal((n, d))
    z -= z.mean(axis=0)
    chol = np.linalg.cholesky(np.atleast_2d(np.cov(z, rowvar=False)))
    return z @ np.linalg.inv(chol).T


def test_fd_identical_sets_is_zero():
    a = np.random.default_rng(0).standard_normal((200, 8))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(torch.as_tensor(a), a.copy()) == pytest.approx(0.0, abs=1e-8)


def test_fd_1d_closed_form():
    a = _whitened(50, 1, 0) * np.sqrt(4.0) + 1.0  # N(1, 4)
    b = _whitened(70, 1, 1) * np.sqrt(9.0) - 2.0  # N(-2, 9)
    # (mu_a - mu_b)^2 + (sigma_a - sigma_b)^2 = 9 + 1
    assert frechet_distance(a, b) == pytest.approx(10.0, rel=1e-9)


def test_fd_diagonal_closed_form():
    mu_a, mu_b = np.array([0.5, -1.0, 2.0]), np.array([0.0, 1.0, 2.5])
    s_a, s_b = np.array([1.0, 4.0, 0.25]), np.array([2.25, 1.0, 1.0])
    a = _whitened(100, 3, 2) * np.sqrt(s_a) + mu_a
    b = _whitened(80, 3, 3) * np.sqrt(s_b) + mu_b
    expected = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(s_a) - np.sqrt(s_b)) ** 2)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)


def test_fd_general_matches_symmetric_form_and_is_symmetric():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((300, 5)) @ rng.standard_normal((5, 5)) + 1.0
    b = rng.exponential(size=(250, 5)) @ rng.standard_normal((5, 5))
    # Tr sqrtm(Sa Sb) == Tr sqrt(Sa^1/2 Sb Sa^1/2), the latter via symmetric eigendecompositions
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(sa)
    sa_half = (v * np.sqrt(w)) @ v.T
    tr_covmean = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh(sa_half @ sb @ sa_half), 0, None)))
    diff = a.mean(0) - b.mean(0)
    expected = diff @ diff + np.trace(sa) + np.trace(sb) - 2 * tr_covmean
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-8)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-8)


def test_fd_errors():
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance(np.zeros((1, 3)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match="feature dimensions differ"):
        frechet_distance(np.random.rand(5, 3), np.random.rand(5, 4))
    with pytest.raises(ValueError, match="2-D"):
        frechet_distance(np.zeros(5), np.zeros(5))


def test_fd_digits_real_vs_noise(digits, judge):
    x_tr, _, x_te, _ = digits
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(x_te.shape, generator=g) * 2 - 1
    f_tr = judge_features(judge, x_tr)
    f_te = judge_features(judge, x_te, batch_size=50)
    f_noise = judge_features(judge, noise)
    assert f_tr.shape == (len(x_tr), judge.feature_dim)
    fd_real = frechet_distance(f_tr, f_te)
    fd_noise = frechet_distance(f_tr, f_noise)
    print(f"FD-digits(train, held-out) = {fd_real:.3f}; FD-digits(train, uniform noise) = {fd_noise:.3f}")
    assert fd_real >= 0.0
    assert fd_noise > 10 * fd_real
