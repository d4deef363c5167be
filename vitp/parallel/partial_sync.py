"""Partially synchronized activations (CAAT-Net, arXiv 2506.19645, NeurIPS 2025): only a fraction ``p`` of
the hidden channels is summed over the tensor-parallel group after each row-parallel layer; the
other channels stay on the rank that computed them, so every TP rank carries its own residual
stream and the block's TP traffic is ``p`` times that of exact tensor parallelism.

The rules, as read in the authors' Megatron fork (repository ``itlamp/Megatron-LM-comms``,
``megatron/core/tensor_parallel/mappings.py`` ``_PartialReduceFromModelParallelRegion``,
``layers.py`` ``RowParallelLinear`` / ``ColumnParallelLinear`` / ``ForwardScaling``,
``ModelParallelConfig.asynch_p``). ``o_r`` is rank ``r``'s partial output ``(B, N, D)`` of a
row-parallel layer (``proj`` or ``fc2``) before the bias, ``k = int(p * D)``:

1. forward: ``y_r[..., :k] = sum_s o_s[..., :k]`` (one all-reduce of ``(B, N, k)``) and
   ``y_r[..., k:] = o_r[..., k:]`` (rank-local); the replicated bias is added after.
2. backward: the same slice of the output gradient is all-reduced, the rest passes through:
   ``grad o_r[..., :k] = sum_s grad y_s[..., :k]``, ``grad o_r[..., k:] = grad y_r[..., k:]``.
   This is the exact gradient once each rank's stream is its own: ``o_r[..., :k]`` feeds every
   rank's stream, ``o_r[..., k:]`` only rank ``r``'s.
3. the column-parallel input's mapping (Megatron ``copy_to_tensor_model_parallel_region``,
   all-reduce of the input gradient) is removed: each rank's ``qkv`` / ``fc1`` reads its own
   stream, so its input gradient is already complete. Per block and micro-batch the traffic is
   two all-reduces of ``(B, N, k)`` forward and two backward: ``p`` times exact TP.
4. private channels: the fork's first version multiplies the private rows ``[k:]`` of the
   row-parallel weight by ``sqrt(tp)`` at initialisation; its later version instead multiplies
   ``y_r[..., k:]`` (bias included) by ``sqrt(tp)`` in forward and their gradient by ``sqrt(tp)``
   in backward (``ForwardScaling``). Reason: a sum of ``tp`` independent partials has ``tp``
   times the variance of one partial.
5. sequence parallelism: their reduce-scatter / all-gather still move all ``D`` channels.

What this module does, and the choices where the paper or the code leaves one:

- rules 1-3 as above, the synchronized slice being the *first* ``k = int(p * D)`` channels;
- rule 4 as ``scale="sqrt_tp"`` (default, the later, persistent form) or ``scale="none"``; the
  factor multiplies the private partial product only, before the bias (the bias is a replicated
  parameter added once; scaling it too would only re-parametrise it). The init-time form is not
  offered: it would make the stored full weights depend on how they were first built.
- sequence parallelism (the part the fork lacks): the synchronized slice is reduce-scattered
  over tokens and all-gathered back (the same bytes as its all-reduce, padded to a multiple of
  tp); the private slice never moves. With private channels no region of the block is
  replicated over the TP group, so there is nothing to shard by tokens: the norms, residual adds
  and modulation see every token of the rank's own stream, as without SP, and the backward
  re-gather of exact SP is not needed.
- every replicated parameter whose consumers see a rank's own stream (row-parallel biases,
  LayerScale, patch embedding, the output head, ...) gets a per-rank partial gradient that is
  summed over the TP group (:func:`vitp.parallel.register_grad_allreduce`, attribute
  ``tp_partial_grad``): replicated parameters stay identical and their gradients exact. (The
  fork leaves them rank-local, so they drift apart.)
- the model output is the mean of the ranks' outputs (:func:`mean_over_tp`): one all-reduce of
  the small ``(B, C, T, H, W)`` prediction per forward, none backward.

``p = 1`` never enters this module: exact tensor parallelism runs unchanged (bit-identical).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import comm

SEQ_DIM = 1
SCALES = ("sqrt_tp", "none")


def check_partial_sync(p: float, scale: str = "sqrt_tp") -> None:
    """Raise ``ValueError`` unless ``0 <= p <= 1`` and ``scale`` is one of :data:`SCALES`."""
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"parallel.partial_sync={p} must be in [0, 1] (1 = exact tensor parallelism)")
    if scale not in SCALES:
        raise ValueError(f"parallel.partial_sync_scale={scale!r}; use one of {SCALES}")


def synced_channels(dim: int, p: float) -> int:
    """Channels ``k = int(p * dim)`` summed over the TP group (the fork's ``int(hidden * p)``).

    Raises ``ValueError`` for ``p`` outside ``[0, 1]``."""
    check_partial_sync(p)
    return int(dim * float(p))


def private_scale(tp: int, scale: str) -> float:
    """Factor on the private channels: ``sqrt(tp)`` for ``"sqrt_tp"``, 1 for ``"none"``."""
    check_partial_sync(1.0, scale)
    return math.sqrt(tp) if scale == "sqrt_tp" else 1.0


def _sum_slice(x: torch.Tensor, group, sp: bool, direction: str, tag: str) -> torch.Tensor:
    """Sum ``x`` ``(B, N, k)`` over ``group``: one all-reduce, or (``sp``) a reduce-scatter over
    tokens (``N`` padded with zeros to a multiple of the group size) and an all-gather back."""
    if not sp:
        return comm.all_reduce(x.clone(), group, direction=direction, tag=tag)
    n, world = x.shape[SEQ_DIM], comm.group_size(group)
    pad = (-n) % world
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    part = comm.reduce_scatter(xp, SEQ_DIM, group, direction=direction, tag=tag)
    return comm.all_gather(part, SEQ_DIM, group, direction=direction, tag=tag)[:, :n]


def _apply_rule(x: torch.Tensor, k: int, scale: float, group, sp: bool, direction: str, tag: str) -> torch.Tensor:
    """``[sum over ranks of x[..., :k], scale * x[..., k:]]`` (forward and backward alike)."""
    out = x * scale if scale != 1.0 else x.clone()
    if k:
        out[..., :k] = _sum_slice(x[..., :k], group, sp, direction, tag)
    return out


class _PartialReduce(torch.autograd.Function):
    """Rules 1, 2 and 4 of the module docstring (the same map forward and backward)."""

    @staticmethod
    def forward(ctx, x, group, k, scale, sp, tag):
        ctx.group, ctx.k, ctx.scale, ctx.sp, ctx.tag = group, k, scale, sp, tag
        return _apply_rule(x, k, scale, group, sp, "fwd", tag)

    @staticmethod
    def backward(ctx, g):
        return _apply_rule(g, ctx.k, ctx.scale, ctx.group, ctx.sp, "bwd", ctx.tag), None, None, None, None, None


def partial_reduce_from_tp_region(x: torch.Tensor, group, k: int, scale: float = 1.0, sequence_parallel: bool = False,
                                  tag: str = "tp") -> torch.Tensor:
    """Row-parallel partial outputs ``(B, N, D)`` -> this rank's stream update ``(B, N, D)``:
    channels ``[:k]`` summed over ``group`` (all-reduce, or reduce-scatter + all-gather over
    tokens with ``sequence_parallel``), channels ``[k:]`` kept and multiplied by ``scale``. The
    backward pass applies the same map to the gradient. With a group of size 1: ``x`` unchanged."""
    if comm.group_size(group) == 1:
        return x
    return _PartialReduce.apply(x, group, int(k), float(scale), bool(sequence_parallel), tag)


class _MeanOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.world = comm.group_size(group)
        return comm.all_reduce(x.clone(), group, direction="fwd", tag=tag).div_(ctx.world)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.world, None, None


def mean_over_tp(x: torch.Tensor, group, tag: str = "head") -> torch.Tensor:
    """Mean of every rank's ``x`` (any shape) over ``group``; the result is identical on every
    rank, so its gradient is too and each rank takes ``1 / tp`` of it (no collective backward)."""
    return x if comm.group_size(group) == 1 else _MeanOverTP.apply(x, group, tag)


@dataclass
class PartialSync:
    """What a row-parallel layer needs to apply the rule (attached as ``layer.partial_sync``).

    ``k``: synchronized channels; ``scale``: factor on the private channels;
    ``sequence_parallel``: move the synchronized slice as reduce-scatter + all-gather.
    """

    k: int
    scale: float
    sequence_parallel: bool
    group: Any = None

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, N, D)`` partial products -> this rank's stream update (bias not included)."""
        return partial_reduce_from_tp_region(y, self.group, self.k, self.scale, self.sequence_parallel)


def partial_sync_of(out_features: int, state: Any) -> PartialSync:
    """The rule for a row-parallel layer with ``out_features`` outputs under ``state`` (a
    :class:`~vitp.parallel.ParallelState` with ``partial_sync < 1``): sum the first
    ``int(state.partial_sync * out_features)`` channels, scale the others by
    :func:`private_scale`, move the synchronized slice as reduce-scatter + all-gather when
    ``state.sequence_parallel``. The column-parallel layers of the same block read their input
    without a collective (rule 3: :class:`vitp.parallel.TPAttention` / ``TPMlp`` with
    ``partial=True``).

    Raises ``ValueError`` for ``partial_sync`` or ``partial_sync_scale`` out of range.
    """
    check_partial_sync(state.partial_sync, state.partial_sync_scale)
    return PartialSync(synced_channels(out_features, state.partial_sync),
                       private_scale(state.tp_size, state.partial_sync_scale), state.sequence_parallel, state.tp_group)
