"""A resume with another LR schedule (``vitp-train --resume RUN optim.lr=...``) trains from its first step with it."""
from __future__ import annotations

import shutil

import torch

from tests.helpers import SMOKE4, compose_cfg, metrics


def test_a_schedule_given_at_resume_trains_the_first_resumed_step(tmp_path):
    """A user's trial: ``vitp-train --resume RUN optim.lr=0.5`` trained the first resumed step at the
    checkpoint's lr (its param groups were restored after the schedule) and only the next one at the
    new schedule's. Now the first resumed step logs and trains at the new schedule's lr: ``optim.lr=0``
    leaves the checkpoint's weights exactly as they were, and another lr, warmup, min lr ratio and
    length give, from step 3 on, the lrs of a run started with them."""
    from vitp.checkpoint import read_export
    from vitp.cli.train import resume_config
    from vitp.train import train

    run, other, fresh = tmp_path / "run", tmp_path / "other", tmp_path / "fresh"
    over = [*SMOKE4, "trainer.exit_at_step=2"]
    train(compose_cfg(over), run, over)
    shutil.copytree(run, other)
    train(resume_config(run, ["optim.lr=0"]), run, resumed=True)
    assert [r["lr"] for r in metrics(run)] == [0.0005, 0.001, 0.0, 0.0]  # warmup 2: lr/2, lr; then lr=0
    before, _ = read_export(run / "checkpoints" / "step_0000002" / "model.safetensors")
    after, _ = read_export(run / "model.safetensors")  # step 4's raw weights
    assert all(torch.equal(before[k], after[k]) for k in before)

    new = ["optim.lr=0.01", "optim.warmup_steps=4", "optim.min_lr_ratio=0.5", "trainer.max_steps=6"]
    train(resume_config(other, new), other, resumed=True)
    train(compose_cfg([*SMOKE4, *new]), fresh)
    got, want = [r["lr"] for r in metrics(other)[2:]], [r["lr"] for r in metrics(fresh)[2:]]
    assert got == want and want[0] != metrics(run)[2]["lr"], (got, want)
