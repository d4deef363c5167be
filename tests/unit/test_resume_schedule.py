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


def test_a_resume_finishes_the_due_step_its_checkpoint_missed_and_logs_the_same_means(tmp_path):
    """A user's trial: a run stopped at an evaluation step (SIGINT during its held-out loss, or
    trainer.exit_at_step, which stops before it) never got that step's held-out loss or grid after
    the resume; and the first logged mean after a resume covered only the resumed steps. Now the
    resumed launch evaluates and samples the checkpoint's step first, and carries the steps since
    the last logged one in the checkpoint: eval.jsonl and metrics.jsonl equal an uninterrupted run's."""
    import json

    from vitp.cli.train import resume_config
    from vitp.train import train

    def evals(run):
        return [(r["step"], r["heldout_loss"]) for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())]

    over = [*SMOKE4, "trainer.log_every=3", "trainer.eval_every=2", "trainer.sample_every=2"]
    full, run = tmp_path / "full", tmp_path / "run"
    train(compose_cfg(over), full, over)
    train(compose_cfg([*over, "trainer.exit_at_step=2"]), run, [*over, "trainer.exit_at_step=2"])
    assert [s for s, _ in evals(run)] == [0] and not (run / "samples" / "step_0000002.png").exists()
    train(resume_config(run, []), run, resumed=True)
    assert [s for s, _ in evals(full)] == [0, 2]
    assert evals(run) == evals(full)  # step 2's held-out loss, before step 3 trained
    assert (run / "samples" / "step_0000002.png").read_bytes() == (full / "samples" / "step_0000002.png").read_bytes()
    got, want = metrics(run), metrics(full)
    assert [r["step"] for r in want] == [1, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]  # step 3: mean of 2, 3
