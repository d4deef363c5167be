"""The pipeline timeline's split of waiting from work (vitp/train/timeline.py: ``wait_times``,
``stage_fractions``) on hand-made events of a 2-stage, 1-micro-batch step whose every interval is
known: stage 0 waits 3 s for the gradient, stage 1 waits 1 s for the activation and 2 s in the
optimizer's clipping collective for stage 0's backward."""
import pytest

from vitp.train.timeline import stage_fractions, stage_metrics, wait_times


def _ev(name, start, end, micro=None):
    args = {"step": 1} if micro is None else {"step": 1, "micro_batch": micro, "buffer_id": 0}
    return {"name": name, "start": start, "end": end, "args": args}


def _rank(stage, events, offset=0.0):
    return {"coords": {"stage": stage, "tp": 0, "cp": 0, "dp": 0, "rank": stage}, "offset": offset, "events": events}


def _step(shift0=0.0):
    """Stage 0: F [0,1], send [1,1.1], recv grad [1.1,4.2] (the grad is sent at 4.1), B [4.2,6.2],
    optimizer [6.2,6.5]; stage 1: recv act [0,1.1] (sent at 1.0), F [1.1,2.1], B [2.1,4.1], send
    grad [4.1,4.2], optimizer [4.2,6.5] (stage 0 arrives at 6.2). ``shift0``: stage 0's clock runs
    that many seconds ahead (its offset corrects it)."""
    s = shift0
    r0 = _rank(0, [_ev("LoadMicroBatch", s, s, 0), _ev("ForwardPass", s, s + 1, 0),
                   _ev("SendActivation", s + 1, s + 1.1, 0), _ev("RecvGrad", s + 1.1, s + 4.2, 0),
                   _ev("BackwardPass", s + 4.2, s + 6.2, 0), _ev("ReduceGrads", s + 6.2, s + 6.2),
                   _ev("OptimizerStep", s + 6.2, s + 6.5), _ev("step", s, s + 6.6)], offset=-s)
    r1 = _rank(1, [_ev("RecvActivation", 0, 1.1, 0), _ev("ForwardPass", 1.1, 2.1, 0), _ev("BackwardPass", 2.1, 4.1, 0),
                   _ev("SendGrad", 4.1, 4.2, 0), _ev("ReduceGrads", 4.2, 4.2), _ev("OptimizerStep", 4.2, 6.5),
                   _ev("step", 0, 6.6)])
    return [r0, r1]


@pytest.mark.parametrize("shift0", [0.0, 1000.0])
def test_waits_come_from_the_peers_events_on_one_clock(shift0):
    w0, w1 = wait_times(_step(shift0))
    assert w0 == pytest.approx([0, 0, 0, 3.0, 0, 0, 0, 0])  # recv grad: from 1.1 until stage 1 sends at 4.1
    assert w1 == pytest.approx([1.0, 0, 0, 0, 0, 2.0, 0])  # recv act until 1.0; clipping until stage 0 at 6.2


def test_stage_fractions_count_waiting_as_idle_and_set_it_against_1f1b():
    f = stage_fractions(_step())
    for s in (0, 1):
        x = f[s]
        assert x["compute"] + x["comm"] + x["optimizer"] + x["idle"] == pytest.approx(1.0)
        assert x["idle"] == pytest.approx(x["wait"] + x["gap"]) and x["gap"] == pytest.approx(0.1 / 6.6)
        assert x["p2p"] == pytest.approx(0.2 / 6.6) and x["compute"] == pytest.approx(3.0 / 6.6)  # 0.1 s per transfer
        assert x["micro_batches"] == 1 and x["compute_ms"] == pytest.approx(3000.0)
        # 1F1B at m = 1 with both stages at 3.2 s per micro-batch (compute + own transfers): the other stage's
        assert x["idle_1f1b_ms"] == pytest.approx(3200.0)
    assert f[0]["wait"] == pytest.approx(3.0 / 6.6) and f[0]["optimizer"] == pytest.approx(0.3 / 6.6)
    assert f[1]["wait"] == pytest.approx(3.0 / 6.6) and f[1]["optimizer"] == pytest.approx(0.3 / 6.6)
    assert f[0]["idle_ms"] == pytest.approx(3100.0) and f[1]["idle_ms"] == pytest.approx(3100.0)
    keys = stage_metrics(f)
    assert keys["profile/stage1_wait"] == pytest.approx(3.0 / 6.6) and keys["profile/stage0_idle_1f1b_ms"] == pytest.approx(3200.0)


def test_unequal_stages_leave_the_faster_stage_more_idle():
    """1F1B with stage times t0 = 2, t1 = 1 (s per micro-batch) and m = 4: the pipeline lasts
    (m - 1) * 2 + 3 = 9 s; stage 0 computes 8 s of it, stage 1 4 s."""
    r0 = _rank(0, [*[_ev("ForwardPass", 2 * k, 2 * k + 2, k) for k in range(4)], _ev("step", 0, 9)])
    r1 = _rank(1, [*[_ev("ForwardPass", 10 + k, 11 + k, k) for k in range(4)], _ev("step", 10, 19)])
    f = stage_fractions([r0, r1])
    assert f[0]["idle_1f1b_ms"] == pytest.approx(1000.0) and f[1]["idle_1f1b_ms"] == pytest.approx(5000.0)


def test_a_trace_of_one_rank_counts_no_wait():
    r0 = _step()[0]
    assert wait_times([r0]) == [[0.0] * 8]
