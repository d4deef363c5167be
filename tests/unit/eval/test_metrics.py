"""Held-out evaluation on a fixed t grid with fixed noise."""

import pytest
import torch

from tests.helpers import compose_cfg
from vitp.data import build_datasets
from vitp.eval import heldout_loss
from vitp.models import Generator


@pytest.fixture(scope="module")
def smoke():
    cfg = compose_cfg(["experiment=smoke"])
    return cfg, Generator.from_config(cfg.model, seed=0).eval(), build_datasets(cfg.data, cfg.seed)


def test_heldout_loss_is_deterministic_and_uses_the_t_grid(smoke):
    cfg, gen, (_, heldout) = smoke
    a, b = heldout_loss(gen, cfg, heldout), heldout_loss(gen, cfg, heldout, batch_size=100)
    assert list(a["heldout_loss_per_t"]) == [f"{(k + 0.5) / 10:.2f}" for k in range(10)]
    assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6)
    # the untrained model predicts x = 0: v_pred - v = -x / (1 - t), so the loss is E[x^2] / (1 - t)^2
    x2 = torch.stack([heldout[(i, None)][0] for i in range(len(heldout))]).pow(2).mean().item()
    for t, v in a["heldout_loss_per_t"].items():
        assert v == pytest.approx(x2 / max(1 - float(t), cfg.objective.t_eps) ** 2, rel=1e-5)
