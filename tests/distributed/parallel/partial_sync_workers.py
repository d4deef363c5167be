"""Rank-side checks of partial synchronization (vitp.parallel.partial_sync) at tp=2, float64:
the sharded generator against the single-process reference (vitp.models.PartialSyncGenerator) in
outputs and every gradient, the same with a fault injected into the rule's backward, the traffic
of one forward/backward by tag, and replicated parameters after optimizer steps."""
from __future__ import annotations

import copy
import dataclasses

import torch

from .tp_workers import build, compare, init, model_cfgs

VARIANTS = ("default", "swiglu", "qk_norm", "layer_scale", "odd_tokens", "video_full", "video_factorized", "text",
            "text_qk_norm_odd")


def _ref_and_tp(cfg, state):
    from vitp.models import PartialSyncGenerator, parallelize_generator

    model, inputs, w = build("gen", cfg)
    ref = PartialSyncGenerator(copy.deepcopy(model), tp=state.tp_size, p=state.partial_sync,
                               scale=state.partial_sync_scale)
    parallelize_generator(model, state)
    return ref, model, inputs, w


def parity(cfg, state):
    ref, model, inputs, w = _ref_and_tp(cfg, state)
    return compare(ref, model, state, inputs, w, rename=lambda n: f"generator.{n}")


def fault_injected(cfg, state):
    """The rule's backward without its all-reduce: the gradients must no longer match."""
    from vitp.parallel import partial_sync as ps

    original = ps._PartialReduce.backward

    def local_only(ctx, g):
        out = g * ctx.scale
        out[..., :ctx.k] = g[..., :ctx.k]
        return out, None, None, None, None, None

    ps._PartialReduce.backward = staticmethod(local_only)
    try:
        return parity(cfg, state)
    finally:
        ps._PartialReduce.backward = original


def traffic(cfg, state):
    """``{"kind/direction/tag": {"count", "bytes"}}`` of one forward + backward."""
    from vitp.parallel import CommRecorder

    ref, model, inputs, w = _ref_and_tp(cfg, state)
    with CommRecorder() as rec:
        (model(*inputs) * w).sum().backward()
    return {"/".join(k): v for k, v in rec.summary().items()}


def replicated_after_steps(cfg, state, steps=3):
    """AdamW steps on the sharded model: replicated parameters stay bit-identical over TP ranks."""
    from vitp.parallel import full_weight

    ref, model, inputs, w = _ref_and_tp(cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        (model(*inputs) * w).sum().backward()
        opt.step()
    reps = {n: p.detach().clone() for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", 0)}
    full = {n: full_weight(p, state) for n, p in model.named_parameters()}
    return {"replicated": {n: t.numpy().tobytes() for n, t in reps.items()}, "n_full": len(full)}


def worker_partial_sync(rank, cfgs):
    from vitp.parallel import make_state

    init(rank)
    base = make_state(tp=2, pp=1, dp=1)
    out = {}
    for p in (0.5, 0.25):
        for sp in (False, True):
            state = dataclasses.replace(base, sequence_parallel=sp, partial_sync=p)
            for name in VARIANTS:
                out[f"parity/{name}/p={p}/sp={sp}"] = parity(cfgs[name], state)
    none = dataclasses.replace(base, partial_sync=0.5, partial_sync_scale="none")
    out["parity/default/p=0.5/scale=none"] = parity(cfgs["default"], none)
    out["parity/default/p=0.0/sp=False"] = parity(cfgs["default"], dataclasses.replace(base, partial_sync=0.0))
    out["fault"] = fault_injected(cfgs["default"], dataclasses.replace(base, partial_sync=0.5))
    for p in (1.0, 0.5, 0.25):
        for sp in (False, True):
            state = dataclasses.replace(base, sequence_parallel=sp, partial_sync=p)
            out[f"traffic/p={p}/sp={sp}"] = traffic(cfgs["default"], state)
    out["steps"] = replicated_after_steps(cfgs["layer_scale"], dataclasses.replace(base, partial_sync=0.5))
    return out


__all__ = ["model_cfgs", "worker_partial_sync"]
