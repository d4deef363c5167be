"""Partial synchronization (CAAT-Net) at tp=2 on CPU gloo, float64: the sharded generator equals
the single-process reference of the rule (vitp.models.PartialSyncGenerator) in outputs and every
gradient, with and without SP, for every generator variant; a fault injected into the rule's
backward is caught; the block traffic is ``p`` times exact TP (checks in partial_sync_workers.py)."""
from __future__ import annotations

import pytest

from tests.helpers import plan_case, run_ranks

from .partial_sync_workers import VARIANTS, worker_partial_sync


@pytest.fixture(scope="module")
def ps2(cfgs):
    return run_ranks(2, worker_partial_sync, cfgs)


def _ok(r, key):
    msg = f"{key}: {r}"
    assert r["same_names"] and not r["missing"], msg
    assert all(n.endswith("k_norm.bias") for n in r["zero_grads"]), msg
    assert r["weights"] == 0.0, msg
    assert r["out"] < 1e-10 and r["loss"] < 1e-10 and r["grad"] < 1e-10, msg


KEYS = [f"parity/{n}/p={p}/sp={sp}" for p in (0.5, 0.25) for sp in (False, True) for n in VARIANTS]


@pytest.mark.parametrize("key", KEYS + ["parity/default/p=0.5/scale=none", "parity/default/p=0.0/sp=False"])
def test_tp2_matches_single_process_reference(ps2, key):
    for rank_res in ps2:
        _ok(rank_res[key], key)


def test_fault_in_backward_is_detected(ps2):
    """The parity check fails when the backward skips the synchronized slice's all-reduce."""
    for r in ps2:
        assert r["fault"]["out"] < 1e-10  # forward untouched
        assert r["fault"]["grad"] > 1e-2, r["fault"]


def _tag_bytes(traffic, tag):
    return sum(v["bytes"] for k, v in traffic.items() if k.endswith("/" + tag))


@pytest.mark.parametrize("sp", [False, True])
def test_block_traffic_scales_with_p(ps2, sp):
    """Tag ``tp`` (the block linears): ``p`` times exact TP without SP. With SP exact TP also
    re-gathers the column inputs in backward (5 tensors per sub-block vs 4), so the ratio is
    ``0.8 p``; the SP boundary traffic disappears (no token-sharded region at ``p < 1``)."""
    r = ps2[0]
    full = _tag_bytes(r[f"traffic/p=1.0/sp={sp}"], "tp")
    for p in (0.5, 0.25):
        t = r[f"traffic/p={p}/sp={sp}"]
        ratio = _tag_bytes(t, "tp") / full
        assert ratio == pytest.approx(p * (0.8 if sp else 1.0), abs=1e-12), (p, sp, ratio)
        assert _tag_bytes(t, "sp_boundary") == 0
        assert t["all_reduce/fwd/head"]["count"] == 1


def test_replicated_params_identical_after_steps(ps2):
    a, b = (r["steps"]["replicated"] for r in ps2)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


# ----------------------------------------------------------------- real training steps, 4 ranks

def _case(tp, pp, dp, p, sp=False):
    return plan_case("S", tp, pp, dp, sp=sp, extra=[f"parallel.partial_sync={p}"])


CASES = {f"{name} p={p}": _case(*lay, p, sp=sp) for name, lay, sp in
         [("2x2x1", (2, 2, 1), False), ("2x1x2", (2, 1, 2), False), ("2x1x2 sp", (2, 1, 2), True)]
         for p in (1.0, 0.5, 0.25)}


@pytest.fixture(scope="module")
def steps4(tmp_path_factory):
    """``{case: [per-rank measurement of one training step]}`` (tests/distributed/plan_measure.py)."""
    from tests.distributed.plan_measure import measure_rank

    per_rank = run_ranks(4, measure_rank, CASES, str(tmp_path_factory.mktemp("ps")), timeout=600)
    return {name: [r[name] for r in per_rank] for name in CASES}


@pytest.mark.parametrize("layout", ["2x2x1", "2x1x2", "2x1x2 sp"])
def test_step_traffic_ratio_and_planner(steps4, layout):
    """TP bytes of one real step (tag ``tp``, every rank): 0.50 / 0.25 of exact TP at p = 0.5 /
    0.25 (0.40 / 0.20 with SP, see above); every collective as ``vitp-plan`` predicts it."""
    from tests.helpers import compose_cfg
    from tests.distributed.plan_measure import predicted_tp_comm
    from vitp.plan import layout_of

    def tp_bytes(name):
        return sum(v["bytes"] for r in steps4[name] for k, v in r["tp_comm"].items() if k.endswith("/tp"))

    factor = 0.8 if layout.endswith("sp") else 1.0
    full = tp_bytes(f"{layout} p=1.0")
    for p in (0.5, 0.25):
        assert tp_bytes(f"{layout} p={p}") / full == pytest.approx(p * factor, abs=1e-12)
    for p in (1.0, 0.5, 0.25):
        name = f"{layout} p={p}"
        cfg = compose_cfg(CASES[name])
        lay = layout_of(cfg, 4)
        for m in steps4[name]:
            pred = predicted_tp_comm(cfg.model, lay, m["stage"])
            assert m["tp_comm"] == pred, (name, m["stage"], m["tp_comm"], pred)
