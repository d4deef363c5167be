"""docs/own-data.md: its CPU commands, run as written (a photo folder of two classes, then
vitp-train on it) for three steps, pass the start-up check without a warning and train; a
step over the check's threshold is warned about once, before step 1, and the run goes on."""
import json
import logging
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_ranks
from tests.unit.test_docs import FENCE

REPO = Path(__file__).resolve().parents[2]


def cpu_commands():
    """The argv of each command in the fenced block of own-data.md's "On a CPU" section."""
    text = (REPO / "docs" / "own-data.md").read_text()
    section = text[text.index("## On a CPU"):text.index("## On a GPU")]
    (block,) = [m.group(2) for m in FENCE.finditer(section)]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _train_in(rank, overrides, run_dir, cwd, warn_over_s=None):
    """``vitp-train overrides`` from ``cwd`` (relative data.root), with the start-up check's
    threshold at ``warn_over_s`` if given; returns the losses and the warnings logged while the
    trainer was built (before step 1)."""
    os.chdir(cwd)
    from vitp.config import compose
    import vitp.train.preflight as pf
    from vitp.train import Trainer

    if warn_over_s is not None:
        pf.STEP_WARN_S = warn_over_s

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger("vitp").addHandler(handler)
    try:
        trainer = Trainer(compose(overrides), run_dir)
    finally:
        logging.getLogger("vitp").removeHandler(handler)
    return {"warnings": seen, "losses": trainer.fit()["losses"]}


def test_the_documented_cpu_command_trains(tmp_path):
    make, train = cpu_commands()
    assert make[:2] == ["python", "scripts/make_photo_folder.py"] and train[0] == "vitp-train"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(REPO / make[1]), *make[2:]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(d.name for d in (tmp_path / "photos").iterdir() if d.is_dir()) == ["cat", "coffee"]
    run = tmp_path / "run"
    res = run_ranks(1, _train_in, [*train[1:], "trainer.max_steps=3"], str(run), str(tmp_path))[0]
    assert res["warnings"] == []  # no start-up warning, no data warning
    assert len(res["losses"]) == 3 and all(math.isfinite(v) for v in res["losses"])
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3
    assert (run / "samples" / "step_0000003.png").is_file() and (run / "model_ema.safetensors").is_file()


def test_a_slow_step_is_warned_about_before_step_1_and_the_run_goes_on(tmp_path):
    res = run_ranks(1, _train_in, ["experiment=smoke", "trainer.max_steps=1"], str(tmp_path / "run"), str(tmp_path),
                    0.0)[0]
    (line,) = res["warnings"]
    assert line.startswith("predicted ") and " s per step (" in line and "over 0 s" in line
    assert "model.patch_size" in line and "trainer.micro_batch_size" in line
    assert len(res["losses"]) == 1
