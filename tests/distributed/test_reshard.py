"""Resuming the whole training state at another layout (vitp.checkpoint.reshard).

An 8-rank run (tp=2 x pp=2 x dp=2) from perturbed weights checkpoints at step 3 and runs to
step 6. The same job "comes back" after step 3 with 4 ranks (tp=2 x pp=2 x dp=1, in its own run
directory, ``trainer.resume=auto``) and, from that checkpoint, as one process: steps 4-6 equal the
uninterrupted run to 5 significant digits (loss, grad norm, lr), and the state written at step 6
(AdamW moments, EMA, weights) equals the uninterrupted run's, so nothing was re-initialised. The
same from a bf16 ZeRO-1 run (to bf16 tolerance after the first resumed step). With
a layout that does not fit the new world size the error names the checkpoint's layout and the
options (``parallel=auto`` re-planning: tests/distributed/test_auto_layout.py). The fp32 and bf16
runs of one world size share a process group (trained in turn: one group start instead of two).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import PERTURBED, assert_rows_close, run_ranks

BASE = ["experiment=smoke", "trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.keep_checkpoints=0",
        "trainer.micro_batch_size=2", f"trainer.init_from={PERTURBED}"]
TP2PP2 = ["parallel.tp=2", "parallel.pp=2"]
KEYS = ("loss", "grad_norm", "lr")


def _train_rank(rank: int, runs: list) -> list:
    """``vitp.train.train`` of every ``(overrides, run dir)`` in ``runs`` in turn, on one forked rank;
    returns each run's ``vitp`` log lines (rank 0's tell the resume)."""
    import logging

    from vitp.config import compose
    from vitp.train import train

    out = []
    for over, run in runs:
        lines: list = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("vitp").addHandler(handler)
        logging.getLogger("vitp").setLevel(logging.INFO)
        try:
            train(compose(over), run)
        finally:
            logging.getLogger("vitp").removeHandler(handler)
        out.append(lines)
    return out


def _train(world: int, runs: list) -> list:
    """Train ``world`` ranks (forked from a preloaded server: a fast start), one process group for
    every ``(overrides, run dir)`` in ``runs`` in turn; rank 0's log text of each."""
    res = run_ranks(world, _train_rank, [(over, str(run)) for over, run in runs], timeout=900)[0]
    return ["\n".join(lines) for lines in res]


def _rows(run: Path, first: int = 0) -> list:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", *KEYS)} for r in rows if r["step"] > first]


def _back_at_step(src: Path, dst: Path, tag: str = "step_0000003") -> Path:
    """``src`` as a job killed after publishing ``tag``: later checkpoints gone, ``latest`` = tag."""
    shutil.copytree(src, dst)
    for t in (dst / "checkpoints").glob("step_*"):
        if t.name > tag:
            shutil.rmtree(t)
    (dst / "checkpoints" / "latest").write_text(tag)
    return dst


def _state(tag: Path) -> dict:
    return {f"{f}:{k}": v for f in ("optimizer", "model", "model_ema")
            for k, v in load_file(tag / f"{f}.safetensors").items()}


def _assert_state_close(a: dict, b: dict, rel: float, abs_: float) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.allclose(a[k], b[k], rtol=rel, atol=abs_)]
    assert not bad, f"{len(bad)} of {len(a)} tensors differ, e.g. {bad[:4]}"


PRECISIONS = {"fp32": [], "bf16": ["trainer.precision=bf16"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For fp32 and for bf16 (ZeRO-1), one process group per world size running both in turn: the
    uninterrupted 8-rank run, the same job back after step 3 with 4 ranks and as one process.
    Returns ``{precision: (full, back4, one, rank 0's log of the 4-rank resume)}``."""
    tmp = tmp_path_factory.mktemp("reshard")
    full = {p: tmp / p / "full8" / "run" for p in PRECISIONS}
    _train(8, [([*BASE, *extra, *TP2PP2], full[p]) for p, extra in PRECISIONS.items()])
    back4 = {p: _back_at_step(full[p], tmp / p / "back4" / "run") for p in PRECISIONS}
    # same run dir, trainer.resume=auto, half the ranks
    logs = _train(4, [([*BASE, *extra, *TP2PP2], back4[p]) for p, extra in PRECISIONS.items()])
    one = {p: tmp / p / "one" / "run" for p in PRECISIONS}
    _train(1, [([*BASE, *extra, f"trainer.resume={full[p] / 'checkpoints' / 'step_0000003'}"], one[p])
               for p, extra in PRECISIONS.items()])
    return {p: (full[p], back4[p], one[p], log) for p, log in zip(PRECISIONS, logs)}


def test_eight_ranks_resume_at_four_and_at_one_process(runs):
    full, back4, one, log = runs["fp32"]
    ref = _rows(full, first=3)
    assert [r["step"] for r in ref] == [4, 5, 6]
    assert_rows_close(_rows(back4, first=3), ref, rel=1e-5)
    assert_rows_close(_rows(one), ref, rel=1e-5)
    assert "at another layout: tp=2 pp=2 dp=2 (8 ranks) -> tp=2 pp=2 dp=1 (4 ranks)" in log
    assert "AdamW moments and step, EMA, LR schedule and data position resharded" in log
    # the state after step 6 equals the uninterrupted run's: moments, EMA and weights were carried
    ref_state = _state(full / "checkpoints" / "step_0000006")
    for run in (back4, one):
        _assert_state_close(_state(run / "checkpoints" / "step_0000006"), ref_state, rel=1e-4, abs_=1e-7)
    meta = json.loads((one / "checkpoints" / "step_0000006" / "vitp_meta.json").read_text())
    ref_meta = json.loads((full / "checkpoints" / "step_0000006" / "vitp_meta.json").read_text())
    assert meta["engine"]["lr_scheduler"] == ref_meta["engine"]["lr_scheduler"]
    assert meta["ema_updates"] == ref_meta["ema_updates"] == 6
    assert (meta["tp"], meta["pp"], meta["dp"]) == (1, 1, 1)


def test_world_size_change_is_explained_or_replanned(runs, tmp_path):
    full = runs["fp32"][0]
    run = _back_at_step(full, tmp_path / "two" / "run")
    before = sorted(p.name for p in run.rglob("*"))
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "vitp.train", *BASE, *TP2PP2, f"hydra.run.dir={run}"], env=env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert ("does not divide world_size=2; valid (tp, pp) for 2 processes: [(1, 1), (1, 2), (2, 1)]. Resuming: the "
            "latest checkpoint (step 3) was written at tp=2 pp=2 dp=2 (8 ranks), this job has 2; relaunch with the "
            "checkpoint's number of ranks, or set parallel=auto to re-plan for 2") in out, out[-3000:]
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written


def test_bf16_zero1_resumes_at_four_ranks_and_one_process(runs):
    """bf16 with ZeRO-1: the 8-rank run's fp32 master weights and moments live in flat partitions
    split over dp=2; resumed by 4 ranks (dp=1) and by one process. The first step after the resume
    at tp=2 x pp=2 x dp=1 computes what the 8 ranks computed (same TP split, same bf16 weights from
    the carried master weights); later steps and the 1-process run differ by bf16 arithmetic of
    another layout (relative 1e-3), and the state after step 6 is close to the uninterrupted run's."""
    full, back4, one, _ = runs["bf16"]
    ref = _rows(full, first=3)
    assert _rows(back4, first=3)[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    for run in (back4, one):
        assert_rows_close(_rows(run, first=3), ref, rel=1e-3)
        a, b = _state(run / "checkpoints" / "step_0000006"), _state(full / "checkpoints" / "step_0000006")
        assert any(k.startswith("optimizer:master/") for k in a)
        _assert_state_close(a, b, rel=2e-2, abs_=1e-4)
