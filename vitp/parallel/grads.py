"""Gradient bookkeeping of a tensor-parallel model: the exact global grad norm, clipping, and the
once-per-step reduction of replicated parameters whose gradients are per-rank partial sums.

Global norm (Megatron-LM ``optimizer/clip_grads.py``
``get_grad_norm_fp32``): a parameter marked ``tensor_model_parallel=True`` holds a different
slice on every TP rank and is counted on each; any other parameter is replicated over the TP
group and counted on TP rank 0 only; the squares are summed over the model-parallel group (the
TP ranks of every pipeline stage of one data-parallel replica), so each element of the model
counts exactly once. Data-parallel gradients are already averaged (identical on every replica).

Deferred partial gradients (Megatron-LM ``finalize_model_grads``, which all-reduces the
sequence-parallel layer-norm gradients once per step): a replicated parameter that sees only
this rank's tokens (sequence parallelism) or heads (q/k norm) gets a partial gradient; summing
it over the TP group once after the last micro-batch's backward, in one flat all-reduce, replaces
one all-reduce per parameter and micro-batch (sums commute with accumulation).

Both read only the marks the model's parallel plan puts on parameters (``tensor_model_parallel``
from its sharding styles, the deferred group from its partial-gradient ones), and
:func:`vitp.parallel.apply_plan` checks that those marks are exactly the roles its rows declare
(:meth:`vitp.parallel.PlanReport.sharded`, :meth:`~vitp.parallel.PlanReport.partial_grad`).
"""
from __future__ import annotations

import math
from typing import Iterable, List

import torch
import torch.nn as nn

from . import comm

_DEFERRED = "_vitp_deferred_tp_group"


def global_grad_norm(params: Iterable[torch.Tensor], tp_rank: int, model_parallel_group=None) -> float:
    """L2 norm of all gradients of the model, each element counted once (module docstring).

    ``params``: this rank's parameters (those without ``.grad`` are skipped). Collective over
    ``model_parallel_group`` when its size is above 1 (every rank of it must call).
    """
    grads = [p.grad for p in params if p.grad is not None and (tp_rank == 0 or getattr(p, "tensor_model_parallel",
                                                                                      False))]
    norms = torch._foreach_norm(grads) if grads else []  # fp32 per tensor, summed in fp64
    sq = torch.stack(norms).double().pow(2).sum() if grads else torch.zeros((), dtype=torch.float64)
    if comm.group_size(model_parallel_group) > 1:
        torch.distributed.all_reduce(sq, group=model_parallel_group)
    return math.sqrt(float(sq))


@torch.no_grad()
def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale gradients by ``max_norm / (total_norm + 1e-6)`` when that is below 1, with the
    arithmetic of DeepSpeed's ZeRO optimizer (``unscale_and_clip_grads``: divide by
    ``(total_norm + 1e-6) / max_norm``), so clipping equals DeepSpeed's to the last bit."""
    if max_norm <= 0:  # clipping off
        return
    clip = (total_norm + 1e-6) / max_norm
    if clip > 1:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / clip)


def defer_grad_allreduce(param: nn.Parameter, group) -> None:
    """Mark ``param``'s gradient as a TP-partial sum for :func:`sync_partial_grads`."""
    setattr(param, _DEFERRED, group)


def deferred_params(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of ``module`` marked by :func:`defer_grad_allreduce`, in module order."""
    return [p for p in module.parameters() if getattr(p, _DEFERRED, None) is not None]


@torch.no_grad()
def sync_partial_grads(module: nn.Module) -> int:
    """Sum the gradients of ``module``'s deferred parameters over their TP group: one flat
    all-reduce per group (tag ``param_grad``). Call once per optimizer step, after the last
    backward and before the data-parallel reduction and the grad norm (every TP rank must call).
    Returns the number of collectives issued."""
    by_group = {}
    for p in deferred_params(module):
        if p.grad is not None:
            by_group.setdefault(id(getattr(p, _DEFERRED)), (getattr(p, _DEFERRED), []))[1].append(p)
    issued = 0
    for group, params in by_group.values():
        if comm.group_size(group) == 1:
            continue
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, group, direction="bwd", tag="param_grad")
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))
        issued += 1
    return issued
