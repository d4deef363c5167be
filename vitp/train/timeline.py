"""Per-stage pipeline timeline of optimizer steps ``trainer.profile_steps = [a, b]`` (issue 29).

Every rank times each instruction DeepSpeed's pipeline engine executes (load, forward, backward,
the four point-to-point transfers, the two gradient reductions, the optimizer step:
:func:`vitp.deepspeed_adapter.pipeline_instructions`) by wrapping it in the engine's instruction
table (:func:`vitp.deepspeed_adapter.patch_instruction`, installed after the step hook, so the
``ReduceGrads`` interval includes the TP-partial gradient sum), and the whole step
(``engine.train_batch`` up to the loss on the host). After each recorded step the ranks' events
are gathered to rank 0 (one ``all_gather_object``, outside the timed step), which logs the
per-stage fractions of that step (:func:`stage_fractions`) and, after step ``b``, writes
``<run dir>/profile/timeline_steps_a-b.json`` (:func:`chrome_trace`, Chrome / Perfetto
``traceEvents``) and one summary line per stage.

What is measured: host wall time, ``time.perf_counter`` before and after each instruction. On
CUDA the wrapper synchronizes the device before and after each instruction while recording, so an
interval holds the instruction's kernels (profiled steps run without CPU/GPU overlap between
instructions; unprofiled steps are unchanged). DeepSpeed's sends and receives are blocking, and the
clipping norm inside ``OptimizerStep`` is a collective over the stages: the time a rank waits for
its peer sits inside those instructions. Rank 0 splits it off (:func:`wait_times`, from the
peers' events on one time axis) and counts it as idle, with the time outside every instruction
(Python between instructions, building the schedule, the loss broadcast at the end of
``train_batch``); so the idle time of a stage is the pipeline bubble and can be set against
1F1B's (:func:`stage_fractions`). Across ranks, events are placed on one time axis by each rank's
``time.time() - time.perf_counter()`` offset (system clocks: exact on one host, NTP-close across
hosts; across hosts the split is as good as the clocks).

Nothing runs when ``trainer.profile_steps`` is empty (no wrapper is installed), and the wrappers
draw no random numbers: losses are unchanged (``tests/distributed/test_timeline.py``).
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

import vitp.deepspeed_adapter as ds
from vitp.parallel import distributed as dist
from vitp.utils import atomic_write_text

log = logging.getLogger("vitp")

# what each instruction counts as in the summary; comm = p2p + reduce
CATEGORY = {"LoadMicroBatch": "compute", "ForwardPass": "compute", "BackwardPass": "compute",
            "SendActivation": "p2p", "RecvActivation": "p2p", "SendGrad": "p2p", "RecvGrad": "p2p",
            "ReduceTiedGrads": "reduce", "ReduceGrads": "reduce", "OptimizerStep": "optimizer"}
FRACTIONS = ("compute", "comm", "optimizer", "idle")  # these add up to 1 per stage and step; idle = wait + gap


def _event(name: str, start_s: float, end_s: float, **args: Any) -> Dict[str, Any]:
    """One recorded interval: instruction ``name``, start and end in seconds (one rank's clock)."""
    return {"name": name, "start": start_s, "end": end_s, "args": args}


class Timeline:
    """Records the instructions of steps ``a..b`` on this rank (``steps = (a, b)``); ``coords``:
    the rank's ``stage``, ``tp``, ``dp``, ``cp`` coordinates. :meth:`install` on the engine once,
    then :meth:`begin` / :meth:`end` around every optimizer step (``end`` is collective on
    recorded steps)."""

    def __init__(self, steps: Sequence[int], coords: Dict[str, int], device: torch.device, run_dir: Path):
        self.first, self.last = int(steps[0]), int(steps[1])
        self.coords, self.run_dir = dict(coords), Path(run_dir)
        self.cuda = device.type == "cuda"
        self.device = device
        self.step: Optional[int] = None  # the step being recorded, else None
        self.events: List[Dict[str, Any]] = []  # this rank's events of the current step
        self.gathered: List[List[Dict[str, Any]]] = []  # rank 0: every step's events of every rank
        self.offset = time.time() - time.perf_counter()  # this rank's perf_counter -> epoch seconds
        self._count: Dict[str, int] = defaultdict(int)  # per instruction kind: micro-batches seen this step

    def install(self, engine: Any) -> None:
        """Wrap every training instruction of ``engine`` with the recorder (after the step hook)."""
        for name in ds.pipeline_instructions():
            ds.patch_instruction(engine, name, self._wrap(name))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _wrap(self, name: str) -> Callable[[Callable], Callable]:
        def wrap(original: Callable) -> Callable:
            def timed(engine: Any, **kwargs: Any) -> Any:
                if self.step is None:
                    return original(engine, **kwargs)
                self._sync()
                start = time.perf_counter()
                try:
                    return original(engine, **kwargs)
                finally:
                    self._sync()
                    self._record(name, start, time.perf_counter(), kwargs.get("buffer_id"))
            return timed
        return wrap

    def _record(self, name: str, start: float, end: float, buffer_id: Optional[int]) -> None:
        args: Dict[str, Any] = {"step": self.step}
        if buffer_id is not None:  # a buffer op: the k-th of its kind in a step is micro-batch k
            args.update(micro_batch=self._count[name], buffer_id=buffer_id)
            self._count[name] += 1
        self.events.append(_event(name, start, end, **args))

    def begin(self, step: int) -> None:
        """Start recording ``step`` when it is in ``[a, b]`` (before ``train_batch``)."""
        if self.first <= step <= self.last:
            self.step, self.events, self._count = step, [], defaultdict(int)
            self._sync()
            self._step_start = time.perf_counter()

    def end(self, step: int) -> Dict[str, float]:
        """Close ``step`` (after ``train_batch``); on a recorded step gather every rank's events
        (collective) and return, on rank 0, the ``profile/*`` metrics of the step
        (:func:`stage_metrics`); after step ``b`` rank 0 also writes the trace. ``{}`` otherwise."""
        if self.step != step:
            return {}
        self._sync()
        self.events.append(_event("step", self._step_start, time.perf_counter(), step=step))
        self.step = None
        mine = {"coords": {**self.coords, "rank": dist.rank()}, "offset": self.offset, "events": self.events}
        ranks = dist.gather_objects(mine)
        self.events = []
        if not dist.is_main():
            return {}
        self.gathered.append(ranks)
        fractions = stage_fractions(ranks)
        if step == self.last:
            self._write(fractions)
        return stage_metrics(fractions)

    def _write(self, last: Dict[int, Dict[str, float]]) -> None:
        """Rank 0: the trace of every recorded step and one log line per stage (over all recorded steps)."""
        path = self.run_dir / "profile" / f"timeline_steps_{self.first}-{self.last}.json"
        per_rank: Dict[int, Dict[str, Any]] = {}
        for ranks in self.gathered:
            for r in ranks:
                row = per_rank.setdefault(r["coords"]["rank"], {"coords": r["coords"], "offset": r["offset"],
                                                                "events": []})
                row["events"] += r["events"]
        atomic_write_text(path, json.dumps(chrome_trace(list(per_rank.values()))) + "\n")
        total = stage_fractions(list(per_rank.values()))
        for stage, f in sorted(total.items()):
            log.info("timeline steps %d-%d stage %d: compute %.3f, comm %.3f (p2p %.3f, reduce %.3f), optimizer "
                     "%.3f, idle %.3f (waiting for other ranks %.3f, between instructions %.3f) of %.1f ms per step; "
                     "idle %.1f ms per step, 1F1B with these stages' work: %.1f ms (m=%g); %s",
                     self.first, self.last, stage, f["compute"], f["comm"], f["p2p"], f["reduce"], f["optimizer"],
                     f["idle"], f["wait"], f["gap"], f["step_ms"], f["idle_ms"], f.get("idle_1f1b_ms", 0.0),
                     f["micro_batches"], path)


# the peer instruction that completes a point-to-point transfer: (peer kind, stage offset of the peer)
P2P_PEER = {"SendActivation": ("RecvActivation", 1), "RecvActivation": ("SendActivation", -1),
            "SendGrad": ("RecvGrad", -1), "RecvGrad": ("SendGrad", 1)}
# collectives inside an instruction and the ranks they wait for: the stage's ranks (the TP-partial
# sum, tied and data-parallel gradient reductions) or every rank (the grad norm of clipping)
COLLECTIVE_GROUP = {"ReduceTiedGrads": "stage", "ReduceGrads": "stage", "OptimizerStep": "all"}


def _absolute(ranks: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every rank's events with ``start`` / ``end`` on one clock (epoch seconds, via the rank's offset)."""
    out = []
    for r in ranks:
        evs = [dict(e, start=e["start"] + r["offset"], end=e["end"] + r["offset"]) for e in r["events"]]
        out.append({"coords": r["coords"], "events": evs})
    return out


def wait_times(ranks: List[Dict[str, Any]]) -> List[List[float]]:
    """Per rank and event (same order as ``ranks[i]["events"]``): seconds of the interval spent
    waiting for another rank, estimated from the peers' events on the common clock.

    A send or receive waits until its peer posts the matching instruction (the same micro-batch
    index, the neighbour stage with the same tp / cp / dp coordinates): ``wait = min(dur, max(0,
    peer start - own start))``; the rest is the transfer. DeepSpeed's p2p is blocking, and gloo's
    and NCCL's sends rendezvous with the receive, so the sender waits too. A collective instruction
    waits for the last rank of its group to arrive (:data:`COLLECTIVE_GROUP`: ``wait = min(dur,
    max(0, latest start in the group - own start))``, over the same step). Events without a
    recorded peer (a trace of some ranks only) count no wait."""
    def p2p_key(c: Dict[str, int], stage: int, name: str, a: Dict[str, Any]) -> tuple:
        return (stage, c["tp"], c["cp"], c["dp"], name, a["step"], a.get("micro_batch"))

    def group_key(c: Dict[str, int], name: str, a: Dict[str, Any]) -> tuple:
        return (c["stage"] if COLLECTIVE_GROUP[name] == "stage" else None, name, a["step"])

    ranks = _absolute(ranks)
    index: Dict[tuple, float] = {}  # (rank key, name, step, micro-batch) -> start
    latest: Dict[tuple, float] = defaultdict(lambda: float("-inf"))  # (group key, name, step) -> latest start
    for r in ranks:
        c = r["coords"]
        for e in r["events"]:
            a = e["args"]
            if e["name"] in P2P_PEER:
                index[p2p_key(c, c["stage"], e["name"], a)] = e["start"]
            if e["name"] in COLLECTIVE_GROUP:
                key = group_key(c, e["name"], a)
                latest[key] = max(latest[key], e["start"])
    out = []
    for r in ranks:
        c, waits = r["coords"], []
        for e in r["events"]:
            a, dur, peer_start = e["args"], e["end"] - e["start"], None
            if e["name"] in P2P_PEER:
                kind, off = P2P_PEER[e["name"]]
                peer_start = index.get(p2p_key(c, c["stage"] + off, kind, a))
            elif e["name"] in COLLECTIVE_GROUP:
                peer_start = latest[group_key(c, e["name"], a)]
            waits.append(min(dur, max(0.0, peer_start - e["start"])) if peer_start is not None else 0.0)
        out.append(waits)
    return out


def stage_fractions(ranks: List[Dict[str, Any]]) -> Dict[int, Dict[str, float]]:
    """Per pipeline stage, over its ranks and the recorded steps: the mean step wall time
    ``step_ms`` and sum of instruction intervals per step ``busy_ms`` (milliseconds), and the
    fractions of the summed step time spent in ``compute`` (load, forward, backward), ``comm`` =
    ``p2p`` (sends and receives) + ``reduce`` (tied and data-parallel gradient reductions),
    ``optimizer``, and ``idle`` = ``wait`` (inside a transfer or collective, waiting for another
    rank to arrive: :func:`wait_times`) + ``gap`` (outside every instruction: Python between
    instructions, the schedule's set-up, the loss broadcast at the end). ``p2p``, ``reduce`` and
    ``optimizer`` exclude the waits. ``compute + comm + optimizer + idle = 1``.

    Against the 1F1B schedule: ``micro_batches`` (m, forward passes per step on the stage),
    ``compute_ms`` (per step), ``idle_ms`` (per step) and ``idle_1f1b_ms``, the idle time 1F1B
    leaves this stage given every stage's measured work: with ``t_s`` the stage's compute and
    transfers (waits excluded) per micro-batch, the pipeline lasts ``(m - 1) max_s t_s + sum_s t_s`` (fill, steady state at the
    slowest stage's pace, drain; Narayanan et al. 2021, §2.2.1), of which stage ``s`` computes
    ``m t_s``; for equal stages ``(p - 1) t`` per step, the bubble ``(p - 1) / (m + p - 1)``.
    ``ranks``: per rank ``{"coords", "offset", "events"}`` (:meth:`Timeline.end`)."""
    sums: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r, waits in zip(ranks, wait_times(ranks)):
        s = sums[r["coords"]["stage"]]
        for e, wait in zip(r["events"], waits):
            dur = (e["end"] - e["start"]) * 1e3
            if e["name"] == "step":
                s["step_ms"] += dur
                s["steps"] += 1
                continue
            s[CATEGORY[e["name"]]] += dur - wait * 1e3
            s["wait"] += wait * 1e3
            s["busy_ms"] += dur
            s["forwards"] += e["name"] == "ForwardPass"
    out = {}
    for stage, s in sums.items():
        wall = s["step_ms"]
        f = {k: s[k] / wall for k in ("compute", "p2p", "reduce", "optimizer", "wait")}
        f["comm"] = f["p2p"] + f["reduce"]
        f["gap"] = 1.0 - s["busy_ms"] / wall
        f["idle"] = f["wait"] + f["gap"]
        f["step_ms"], f["busy_ms"] = wall / s["steps"], s["busy_ms"] / s["steps"]
        f["micro_batches"] = s["forwards"] / s["steps"]
        f["compute_ms"], f["idle_ms"] = s["compute"] / s["steps"], f["idle"] * wall / s["steps"]
        out[stage] = f
    # a stage's time per micro-batch: its compute and its own transfers (the planner's micro_s)
    per_micro = {st: (f["compute_ms"] + f["p2p"] * f["step_ms"]) / f["micro_batches"]
                 for st, f in out.items() if f["micro_batches"]}
    for st, f in out.items():
        m = f["micro_batches"]
        if per_micro and m:
            pipeline = (m - 1) * max(per_micro.values()) + sum(per_micro.values())
            f["idle_1f1b_ms"] = pipeline - m * per_micro[st]
    return out


def stage_metrics(fractions: Dict[int, Dict[str, float]]) -> Dict[str, float]:
    """``profile/stage{s}_{compute,comm,p2p,reduce,optimizer,idle,wait,gap}`` (fractions of the
    step), ``profile/stage{s}_{step_ms,busy_ms,idle_ms,idle_1f1b_ms}`` (milliseconds per step) of
    :func:`stage_fractions`."""
    keys = (*FRACTIONS, "p2p", "reduce", "wait", "gap", "step_ms", "busy_ms", "idle_ms", "idle_1f1b_ms")
    return {f"profile/stage{s}_{k}": f[k] for s, f in sorted(fractions.items()) for k in keys if k in f}


def chrome_trace(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The Chrome / Perfetto trace (``{"traceEvents": [...]}``, ``chrome://tracing`` JSON format) of
    ``ranks`` (per rank ``{"coords", "offset", "events"}``): one process per pipeline stage, one
    thread row per rank, a complete event (``"ph": "X"``, ``ts`` / ``dur`` in microseconds from
    the earliest event of any rank) per instruction and per step (``"cat": "step"``, enclosing the
    step's instructions); ``args`` hold the step, micro-batch and buffer id and the rank's
    coordinates."""
    t0 = min((e["start"] + r["offset"] for r in ranks for e in r["events"]), default=0.0)
    out: List[Dict[str, Any]] = []
    for r in sorted(ranks, key=lambda r: r["coords"]["rank"]):
        c = r["coords"]
        pid, tid = c["stage"], c["rank"]
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"stage {pid}"}})
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"name": f"rank {tid} (tp {c['tp']}, cp {c['cp']}, dp {c['dp']})"}})
        for e in r["events"]:
            step = e["name"] == "step"
            out.append({"name": f"step {e['args']['step']}" if step else e["name"],
                        "cat": "step" if step else CATEGORY[e["name"]], "ph": "X", "pid": pid, "tid": tid,
                        "ts": (e["start"] + r["offset"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                        "args": {**e["args"], **c}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
