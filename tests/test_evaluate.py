"""Held-out evaluation, weight files and sample grids."""

import pytest
import torch

from conftest import compose_cfg
from vitp.data import build_datasets
from vitp.evaluate import heldout_loss, load_weights, save_weights, to_grid
from vitp.models import Generator


@pytest.fixture(scope="module")
def smoke():
    cfg = compose_cfg(["experiment=smoke"])
    return cfg, Generator(cfg.model, seed=0).eval(), build_datasets(cfg.data, cfg.seed)


def test_heldout_loss_is_deterministic_and_uses_the_t_grid(smoke):
    cfg, gen, (_, heldout) = smoke
    a, b = heldout_loss(gen, cfg, heldout), heldout_loss(gen, cfg, heldout, batch_size=100)
    assert list(a["heldout_loss_per_t"]) == [f"{(k + 0.5) / 10:.2f}" for k in range(10)]
    assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6)
    # the untrained model predicts x = 0: v_pred - v = -x / (1 - t), so the loss is E[x^2] / (1 - t)^2
    x2 = torch.stack([heldout[(i, None)][0] for i in range(len(heldout))]).pow(2).mean().item()
    for t, v in a["heldout_loss_per_t"].items():
        assert v == pytest.approx(x2 / max(1 - float(t), cfg.objective.t_eps) ** 2, rel=1e-5)


def test_weights_round_trip_and_bad_files(smoke, tmp_path):
    cfg, gen, _ = smoke
    save_weights(tmp_path, cfg, gen.state_dict(), gen.state_dict())
    loaded, cfg2 = load_weights(tmp_path / "model_ema.safetensors")
    assert cfg2.model.width == cfg.model.width
    for k, v in gen.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    assert not list(tmp_path.glob("*.tmp"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="bad.safetensors is corrupt"):
        load_weights(bad)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes((tmp_path / "model.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match="trunc.safetensors is corrupt"):
        load_weights(trunc)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "missing.safetensors")


def test_grid_layout():
    x = torch.zeros(6, 1, 1, 8, 8)
    grid = to_grid(x, nrow=3)
    assert grid.shape == (3, 2 * 64 + 3 * 2, 3 * 64 + 4 * 2)
