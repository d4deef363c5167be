"""Smoke run of ``scripts/bench_schedule.py --quick`` as a subprocess (the pattern of
``tests/unit/test_scripts.py``): vitp's DeepSpeed 1F1B step, torch's ``Schedule1F1B`` and
``ScheduleInterleaved1F1B`` on the tiny model at pp=2 train the same model alike and are timed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAMES = ("deepspeed_1f1b", "torch_1f1b", "torch_interleaved_1f1b")


def _run(args, tmp_path: Path) -> str:
    """Run ``args`` (after ``sys.executable``) from the repo root with a CPU environment; return stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "NO_ALBUMENTATIONS_UPDATE": "1",
           "TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.mark.slow
def test_bench_schedule_quick(tmp_path):
    out = tmp_path / "sched"
    _run(["scripts/bench_schedule.py", "--quick", "--steps", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.with_suffix(".json").read_text())
    from vitp.config import compose
    from vitp.models import Generator

    tiny = compose(["model=tiny", "data.channels=1", "data.resolution=8", "data.num_classes=10", "model.depth=4"])
    n_params = len(list(Generator.from_config(tiny.model).parameters()))
    assert res["pp"] == 2 and res["model"]["depth"] == 4 and set(res["micro_batches"]) == {"2", "4"}
    assert "| m | variant |" in out.with_suffix(".md").read_text()
    for r in res["micro_batches"].values():
        # one stage per rank as DeepSpeed cuts it: [Embed, 2 blocks] | [2 blocks, FinalLayer]; the
        # interleaved chunks [Embed, 1 block], [1 block], [1 block], [1 block, FinalLayer] by rank r, r + 2
        assert r["layers_per_rank"]["torch_1f1b"] == [[0, 3], [3, 6]]
        assert r["layers_per_rank"]["torch_interleaved_1f1b"] == [[[0, 2], [3, 4]], [[2, 3], [4, 6]]]
        assert r["blocks_per_rank"]["torch_interleaved_1f1b"] == r["blocks_per_rank"]["torch_1f1b"] == [2, 2]
        loss = r["first_loss"]
        assert loss["deepspeed_1f1b"] > 0
        for n in NAMES[1:]:
            assert loss[n] == pytest.approx(loss["deepspeed_1f1b"], rel=1e-5)
            p = r["parity"][n]
            assert p["params"] == n_params and p["init_weights_max_abs_diff"] == 0.0
            # 3 steps: at step 1 only the zero-initialised output layer has a gradient; by step 3 every
            # parameter does, so the gradients sent back across the stages are compared too
            steps = p["steps"]
            assert len(steps) == 3 and steps[0]["params_nonzero_grad"] < steps[-1]["params_nonzero_grad"] == n_params
            for st in steps:
                # averaged over the m micro-batches as DeepSpeed does (scale_grads=True): a sum would
                # differ by (m - 1) x the gradient, a relative grad-norm difference of m - 1
                assert st["grads_max_abs_diff"] <= 1e-6 * st["grad_max_abs"]
                assert st["grad_norm_rel_diff"] <= 1e-6 and st["loss_rel_diff"] <= 1e-5
            assert p["weights_after_max_abs_diff"] <= 1e-6
        for n in NAMES:
            t = r["times"][n]
            assert 0 < t["step_ms_min"] <= t["step_ms"] <= t["step_ms_max"] and t["ratio"] > 0
        assert r["times"]["deepspeed_1f1b"]["ratio"] == 1.0
