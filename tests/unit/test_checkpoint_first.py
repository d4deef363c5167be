"""A step's checkpoint is saved before its sample grid and held-out loss (vitp.train.trainer
``Trainer._after_step``): a grid that fails (a damaged VAE, out of memory in a decode) loses no
trained step, and a stop during that grid does not save the step twice."""
from __future__ import annotations

import pytest

from tests.helpers import SMOKE4, compose_cfg


def test_a_failing_grid_leaves_the_steps_checkpoint(tmp_path, monkeypatch):
    from vitp.checkpoint import published_tags
    from vitp.train import train
    from vitp.train.trainer import Trainer

    def broken(self, step):
        raise RuntimeError("the grid failed")

    monkeypatch.setattr(Trainer, "sample_grid", broken)
    cfg = compose_cfg([*SMOKE4, "trainer.sample_every=2", "trainer.checkpoint_every=2", "trainer.eval_every=0"])
    with pytest.raises(RuntimeError, match="the grid failed"):
        train(cfg, tmp_path / "run")
    assert "step_0000002" in published_tags(tmp_path / "run" / "checkpoints")


def test_a_stop_during_the_grid_after_a_due_checkpoint_saves_it_once(tmp_path, monkeypatch):
    from vitp.eval.progress import EvaluationStopped
    from vitp.train import train
    from vitp.train.checkpointer import Checkpointer
    from vitp.train.trainer import Trainer

    saves, save = [], Checkpointer.save

    def counted(self, step, *args, **kwargs):
        saves.append(step)
        return save(self, step, *args, **kwargs)

    def stopped(self, step):
        raise EvaluationStopped  # what a signal during the grid's forwards raises

    monkeypatch.setattr(Checkpointer, "save", counted)
    monkeypatch.setattr(Trainer, "sample_grid", stopped)
    cfg = compose_cfg([*SMOKE4, "trainer.sample_every=2", "trainer.checkpoint_every=2", "trainer.eval_every=0"])
    out = train(cfg, tmp_path / "run")
    assert out["stopped_at"] == 2 and saves == [2]
