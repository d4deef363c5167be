"""Measured per-rank bytes of real training steps, to check the planner's memory model against.

For one layout (a list of ``vitp-train`` overrides) on every rank of a :func:`tests.helpers.run_ranks`
group: build the real :class:`vitp.train.Trainer` (DeepSpeed pipeline engine, TP plan, ZeRO
optimizer), run one ``engine.train_batch`` (all micro-batches of a step through 1F1B) and return

- ``weights``: bytes of the distinct storages behind the module's parameters (ZeRO's flat buffer);
- ``grads``: the peak, during the step, of the distinct storages behind ``param.grad``;
- ``optimizer``: distinct storages reachable from the DeepSpeed optimizer after the step (fp32
  master partition, AdamW moments), parameters excluded;
- ``activations``: the peak, during the step, of the distinct live storages autograd saved for
  backward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded; a storage counts
  while any tensor on it is alive), the tensors activation checkpointing rebuilds in backward,
  and the stage outputs the pipeline engine holds;
- ``ema``: the trainer's EMA copy of the rank's parameters;
- ``bucket``: bytes of ZeRO-1's contiguous gradient buckets at the gradient reduction;
- ``tp_comm``: the step's TP and context-parallel collectives from :class:`vitp.parallel.CommRecorder`
  (``{"kind/direction/tag": {"count", "bytes"}}``).
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def _key(t: torch.Tensor) -> Tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class LiveBytes:
    """Distinct live storages added so far (weak references) and the peak of their total bytes."""

    def __init__(self, exclude: Iterable[Tuple[int, int]] = ()):
        self.exclude = set(exclude)
        self.live: Dict[Tuple[int, int], StorageWeakRef] = {}
        self.peak = 0

    def add(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            k = _key(t)
            if k not in self.exclude and k[1] and (k not in self.live or self.live[k].expired()):
                self.live[k] = StorageWeakRef(t.untyped_storage())
            self.update()
        return t

    def update(self) -> None:
        for k in [k for k, ref in self.live.items() if ref.expired()]:
            del self.live[k]
        self.peak = max(self.peak, sum(k[1] for k in self.live))


def _tensors(obj, depth: int = 0, seen=None) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through containers and DeepSpeed/torch objects (not modules)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(k, depth + 1, seen)
            yield from _tensors(v, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) \
            and type(obj).__module__.split(".")[0] in ("deepspeed", "torch", "vitp"):
        for v in vars(obj).values():
            yield from _tensors(v, depth + 1, seen)


def _distinct_bytes(tensors: Iterable[torch.Tensor], exclude=()) -> int:
    keys = {_key(t) for t in tensors if t.device.type != "meta"} - set(exclude)
    return sum(k[1] for k in keys)


def _track_recomputation(acts: LiveBytes):
    """Make activation checkpointing's recomputation (torch's non-reentrant ``checkpoint``) also
    report the tensors it rebuilds to ``acts``; returns the original hook class to restore."""
    import torch.utils.checkpoint as ckpt

    original = ckpt._recomputation_hook

    class Tracked(original):
        def __init__(self, frame_ref, gid):
            super().__init__(frame_ref, gid)
            inner = self.pack_hook

            def pack_hook(x):
                acts.add(x)
                return inner(x)

            pack_hook._checkpoint_internal = True
            self.pack_hook = pack_hook

    ckpt._recomputation_hook = Tracked
    return original


def _measure_step(tr) -> dict:
    from vitp.parallel import CommRecorder

    eng = tr.engine
    params = list(eng.module.parameters())
    pkeys = {_key(p) for p in params}
    acts, grads = LiveBytes(pkeys), LiveBytes(pkeys)

    def track_grad(p) -> None:
        grads.add(p.grad)

    hooks = [p.register_post_accumulate_grad_hook(track_grad) for p in params if p.requires_grad]

    def track_outputs(_m, _a, out) -> None:  # returns None: the output stays as it is
        for t in out if isinstance(out, (tuple, list)) else (out,):
            acts.add(t)

    hooks.append(eng.module.register_forward_hook(track_outputs))
    bucket = []
    release = getattr(eng.optimizer, "_release_ipg_buffers", None)  # ZeRO-1/2: frees the gradient bucket
    if release is not None:
        def record_and_release():
            bucket.append(sum(buf.numel() * buf.element_size() for b in eng.optimizer.ipg_buckets.values()
                              for buf in b.buffer))
            release()
        eng.optimizer._release_ipg_buffers = record_and_release
    recompute = _track_recomputation(acts)
    try:
        # pack a detached alias: the tensor itself would hold its grad_fn, and a node saving its own
        # output would then keep itself alive (DeepSpeed backpropagates stage outputs with retain_graph)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: acts.add(t).detach(), lambda t: t), \
                CommRecorder() as rec:
            eng.train_batch(data_iter=tr.data_iter)
    finally:
        torch.utils.checkpoint._recomputation_hook = recompute
        for h in hooks:
            h.remove()
        if release is not None:
            del eng.optimizer._release_ipg_buffers
    return {"weights": _distinct_bytes(params), "grads": grads.peak, "activations": acts.peak,
            "optimizer": _distinct_bytes(_tensors(eng.optimizer), exclude=pkeys), "bucket": max(bucket, default=0),
            "params": sum(p.numel() for p in params),
            "tp_comm": {"/".join(k): v for k, v in rec.summary().items()}}


def measure_rank(rank: int, cases: Dict[str, List[str]], base: str) -> Dict[str, dict]:
    """On every rank of a process group: ``{case: measurement of this rank}`` for each
    ``{case: overrides}`` (see the module docstring), plus this rank's stage and tp rank."""
    from vitp.config import compose
    from vitp.train import Trainer

    out = {}
    for name, overrides in cases.items():
        tr = Trainer(compose(overrides), f"{base}/{name}")
        try:
            out[name] = {**_measure_step(tr), "stage": tr.state.pp_rank, "tp_rank": tr.state.tp_rank,
                         "ema": _distinct_bytes(tr.ema.params.values())}
        finally:
            if tr.batches is not None:
                tr.batches.close()
            tr.logger.close()
            tr.lock.release()
    return out


def predicted_tp_comm(model_cfg, lay, stage: int) -> Dict[str, dict]:
    """The planner's collectives of one step on ``stage`` (TP and context-parallel:
    :func:`vitp.plan.plan_collectives`), in :func:`measure_rank`'s ``tp_comm`` form (which holds
    every collective :class:`vitp.parallel.CommRecorder` saw): ``{"kind/direction/tag": {"count":
    n, "bytes": b}}``."""
    from vitp.plan import plan_collectives

    pred: Dict[str, dict] = {}
    for c in plan_collectives(model_cfg, lay, stage):
        e = pred.setdefault(f"{c.kind}/{c.direction}/{c.tag}", {"count": 0, "bytes": 0})
        k = 1 if c.per_step else lay.accum
        e["count"] += c.count * k
        e["bytes"] += c.count * c.nbytes * k
    return pred
