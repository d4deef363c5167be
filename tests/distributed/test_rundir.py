"""A restarted run shows one history; another config is refused (the busy-folder refusal is in
test_launchers.py, against a live run)."""
import json
import shutil

import pytest

from tests.helpers import metrics, run_ranks
from vitp.config import compose


def _tb_steps(run, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _crash_before_first_checkpoint(run):
    """What a run killed before its first checkpoint leaves: its logs, samples, events and config."""
    shutil.rmtree(run / "checkpoints")
    for p in run.glob("model*"):
        p.unlink()


def test_restart_before_the_first_checkpoint_shows_one_history(tmp_path):
    run_ranks(1, _restart_before_the_first_checkpoint, tmp_path / "run")  # keeps the process group out of pytest's


def _restart_before_the_first_checkpoint(rank, run):
    from vitp.train import train

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
