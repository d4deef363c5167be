"""vitp-plan against measurement: per-rank parameter, gradient, optimizer and activation bytes of
real training steps (tests/distributed/plan_measure.py) within 10 % of the prediction for 15
layouts of two model sizes (image "S", video "V", tests.helpers.PLAN_MODELS) on 4 gloo ranks, the
TP collectives exactly as predicted, and the telemetry of a real run (metrics.jsonl, TensorBoard)."""
from __future__ import annotations

import json

import pytest

from tests.distributed.plan_measure import measure_rank, predicted_tp_comm
from tests.helpers import compose_cfg, plan_case, run_ranks, train_rank
from vitp.plan import layout_of, stage_memory, step_comm

TOL = 0.10
CASES = {
    "S 1x1x4": plan_case("S", 1, 1, 4),
    "S 2x1x2": plan_case("S", 2, 1, 2),
    "S 2x1x2 sp": plan_case("S", 2, 1, 2, sp=True),
    "S 1x2x2": plan_case("S", 1, 2, 2),
    "S 2x2x1 sp": plan_case("S", 2, 2, 1, sp=True),
    "S 1x4x1 ac1": plan_case("S", 1, 4, 1, ac=1),
    "S 4x1x1 sp ac1": plan_case("S", 4, 1, 1, sp=True, ac=1),
    "V 1x1x4": plan_case("V", 1, 1, 4),
    "V 2x1x2 sp": plan_case("V", 2, 1, 2, sp=True),
    "V 4x1x1 sp (padded)": plan_case("V", 4, 1, 1, sp=True),
    "V 2x2x1": plan_case("V", 2, 2, 1),
    "V 1x2x2 ac1": plan_case("V", 1, 2, 2, ac=1),
    "V 2x2x1 sp ac1": plan_case("V", 2, 2, 1, sp=True, ac=1),
    "V 1x2x2 bf16": plan_case("V", 1, 2, 2, extra=["trainer.precision=bf16"]),
    "V 1x4x1 ac2": plan_case("V", 1, 4, 1, ac=2),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``{case: [per-rank measurement]}`` (one process group for every case)."""
    per_rank = run_ranks(4, measure_rank, CASES, str(tmp_path_factory.mktemp("plan")), timeout=600)
    return {name: [r[name] for r in per_rank] for name in CASES}


def _rows(measured):
    """One row per (case, pipeline stage): measured vs predicted bytes of a rank of that stage."""
    rows = []
    for name, ranks in measured.items():
        cfg = compose_cfg(CASES[name])
        pred = stage_memory(cfg.model, layout_of(cfg, 4))
        for m in {r["stage"]: r for r in ranks}.values():
            p = pred[m["stage"]]
            rows.append({"case": name, "stage": m["stage"], "params": (m["params"], p.params),
                         "weights": (m["weights"], p.weights), "grads": (m["grads"], p.grads),
                         "optimizer": (m["optimizer"], p.optimizer), "ema": (m["ema"], p.ema),
                         "activations": (m["activations"], p.activations + p.recompute + p.pipe_buffers),
                         "bucket": (m["bucket"], p.zero_buckets)})
    return rows


def test_memory_predictions_within_10_percent(measured):
    rows = _rows(measured)
    keys = ("weights", "grads", "optimizer", "ema", "activations")
    print(f"\n{'case':22} st | " + " | ".join(f"{k:>21} (meas / pred / err)" for k in keys))
    bad = []
    for r in rows:
        errs = {k: r[k][1] / r[k][0] - 1 for k in keys}
        print(f"{r['case']:22} {r['stage']:>2} | " + " | ".join(
            f"{r[k][0]:>10} {r[k][1]:>10.0f} {errs[k]:+6.1%}" for k in keys))
        bad += [(r["case"], r["stage"], k, f"{e:+.1%}") for k, e in errs.items() if abs(e) > TOL]
        assert r["params"][0] == r["params"][1], r
        assert r["bucket"][0] == r["bucket"][1], r  # ZeRO-1's two gradient buckets, exactly
    assert len({r["case"].split()[0] for r in rows}) == 2 and len(measured) >= 12
    assert not bad, bad


def test_tp_collectives_are_predicted_exactly(measured):
    for name, ranks in measured.items():
        cfg = compose_cfg(CASES[name])
        lay = layout_of(cfg, 4)
        for m in ranks:
            pred = predicted_tp_comm(cfg.model, lay, m["stage"])
            assert m["tp_comm"] == pred, (name, m["stage"])


def test_telemetry_of_a_run(tmp_path):
    """tp=2 + SP x pp=2: metrics.jsonl and TensorBoard carry tokens/s, TFLOP/s, MFU, memory, data
    wait and TP/PP/DP bytes; the counted TP bytes equal the planner's; losses are unchanged
    (tests/distributed/test_reference.py holds the bit-identical fixtures)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    over = [*plan_case("S", 2, 2, 1, sp=True), "trainer.max_steps=3", "trainer.log_every=1"]
    run_ranks(4, train_rank, over, str(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    cfg = compose_cfg(over)
    comm = step_comm(cfg.model, layout_of(cfg, 4))
    keys = ("perf/tokens_per_s", "perf/tflops", "perf/mfu", "perf/peak_mem_gib", "perf/data_wait_frac",
            "comm/tp_bytes", "comm/pp_bytes", "comm/dp_bytes")
    for r in rows:
        assert set(keys) <= set(r) and r["perf/tokens_per_s"] > 0 and 0 < r["perf/mfu"] and 0 <= r[
            "perf/data_wait_frac"] < 1
        assert r["comm/tp_bytes"] == max(c.tp_bytes for c in comm) and r["comm/pp_bytes"] == max(
            c.pp_bytes for c in comm) and r["comm/dp_bytes"] == 0
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert set(keys) <= set(acc.Tags()["scalars"])
