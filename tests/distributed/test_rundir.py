"""One owner per run directory; a restarted run shows one history; another config is refused."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import compose_cfg, metrics
from vitp.config import compose


def _tb_steps(run, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_a_second_command_into_a_busy_run_dir_is_refused(tmp_path):
    """Run A (seed 0) owns the folder; B (seed 1) into the same folder exits 2 naming A's pid; A's
    outputs hold only A's steps."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1")
    args = [sys.executable, "-m", "vitp.train", "experiment=smoke", "trainer.max_steps=400",
            "trainer.checkpoint_every=10", "trainer.log_every=1", f"hydra.run.dir={run}"]
    a = subprocess.Popen([*args, "seed=0"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").is_file():
            time.sleep(0.2)
        b = subprocess.run([*args, "seed=1"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert a.poll() is None, "run A ended before B tried the folder"
    finally:
        a.send_signal(signal.SIGTERM)
        out_a, _ = a.communicate(timeout=120)
    assert b.returncode == 2, b.stdout[-2000:] + b.stderr[-2000:]
    assert f"run dir {run} is in use by another vitp-train" in b.stdout + b.stderr
    assert f'"pid": {a.pid}' in b.stdout + b.stderr
    assert a.returncode == 0, out_a[-2000:]
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 1
    assert compose_cfg(["experiment=smoke"]).seed == 0 and "seed: 0" in (run / ".hydra" / "config.yaml").read_text()


def _crash_before_first_checkpoint(run):
    """What a run killed before its first checkpoint leaves: its logs, samples, events and config."""
    shutil.rmtree(run / "checkpoints")
    for p in run.glob("model*"):
        p.unlink()


def test_restart_before_the_first_checkpoint_shows_one_history(tmp_path):
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "model.depth=2", "trainer.sample_every=1", "trainer.eval_every=2",
            "trainer.log_every=1", "trainer.checkpoint_every=0"]
    train(compose([*over, "trainer.max_steps=3"]), run)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert _tb_steps(run, "eval/heldout_loss") == [0, 2]
    _crash_before_first_checkpoint(run)

    train(compose([*over, "trainer.max_steps=2"]), run)  # the same run, relaunched
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0]  # 2 is the last
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0000001.png", "step_0000002.png"]
    assert _tb_steps(run) == [1, 2]
    assert _tb_steps(run, "eval/heldout_loss") == [0]

    _crash_before_first_checkpoint(run)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"holds another config's run \(model.depth: 2 before vs 3 now\)"):
        train(compose([*over, "model.depth=3", "trainer.max_steps=2"]), run)
    assert (run / "metrics.jsonl").read_text() == before
    assert "depth: 2" in (run / ".hydra" / "config.yaml").read_text()
