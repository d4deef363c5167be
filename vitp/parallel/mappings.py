"""Autograd-aware communication between the replicated, tensor-parallel and sequence-parallel
regions of a transformer block.

Reference semantics: Megatron-Core ``megatron/core/tensor_parallel/mappings.py`` (Shoeybi et al.
2019, "Megatron-LM", §3, the ``f``/``g`` operators; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.2.2, the ``g``/``g-bar`` operators of sequence
parallelism). Tokens are ``(B, N, D)`` and the sequence (token) dimension is **dim 1**.

======================================  ==============================  =========================
function                                forward                         backward
======================================  ==============================  =========================
``copy_to_tp_region``                   identity                        all-reduce
``reduce_from_tp_region``               all-reduce                      identity
``sum_over_tp_region``                  all-reduce                      all-reduce
``scatter_to_sequence_region``          split dim 1                     all-gather dim 1
``reduce_scatter_to_sequence_region``   reduce-scatter dim 1            all-gather dim 1
``gather_from_sequence_region_to_       all-gather dim 1                split dim 1
replicated``
``gather_from_tp_region``               all-gather last dim             split last dim, or
                                                                        reduce-scatter last dim
                                                                        (``partial_grad=True``)
``all_to_all``                          all-to-all (scatter s, gather   all-to-all (scatter g,
                                        g)                              gather s)
``split_to_context_region``             split dim 1                     zero-pad dim 1
``gather_from_context_region``          all-gather dim 1                split dim 1, times cp
======================================  ==============================  =========================

The context-parallel pair (:mod:`vitp.parallel.context`) differs from the sequence-parallel one
because parameter gradients are summed over the cp group afterwards: a rank's share of a sample's
gradient flows back through its own tokens only.

``sum_over_tp_region`` is a sum that every rank consumes differently (a norm's statistic over a
width split by heads, each rank normalising its own channels with it): the total's gradient is the
sum of the ranks' partial ones, which every rank's summand receives.

``gather_from_sequence_region_to_replicated`` feeds replicated computation (every rank computes
the same gradient, so each keeps its slice). With a group of size 1 every function is the
identity. All collectives go through :mod:`vitp.parallel.comm` (counted by ``CommRecorder``).
"""
from __future__ import annotations

import torch

from . import comm

SEQ_DIM = 1


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = comm.group_size(group), comm.group_rank(group)
    if x.shape[dim] % world:
        raise ValueError(f"cannot split size {x.shape[dim]} of dim {dim} over {world} ranks")
    return x.chunk(world, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.clone(), ctx.group, direction="bwd", tag=ctx.tag), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        return comm.all_reduce(x.clone(), group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return comm.all_reduce(x.clone(), group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.clone(), ctx.group, direction="bwd", tag=ctx.tag), None, None


class _Scatter(torch.autograd.Function):
    """Split along ``dim`` (fwd) / all-gather (bwd)."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.dim, ctx.group, direction="bwd", tag=ctx.tag), None, None, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` (fwd) / reduce-scatter or split (bwd)."""

    @staticmethod
    def forward(ctx, x, dim, group, tag, reduce_grad):
        ctx.dim, ctx.group, ctx.tag, ctx.reduce_grad = dim, group, tag, reduce_grad
        return comm.all_gather(x, dim, group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            g = comm.reduce_scatter(g, ctx.dim, ctx.group, direction="bwd", tag=ctx.tag)
        else:
            g = _split(g, ctx.dim, ctx.group)
        return g, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` (fwd) / all-gather (bwd)."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return comm.reduce_scatter(x, dim, group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.dim, ctx.group, direction="bwd", tag=ctx.tag), None, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all ``(scatter, gather)`` (fwd) / its transpose ``(gather, scatter)`` (bwd)."""

    @staticmethod
    def forward(ctx, x, scatter, gather, group, tag):
        ctx.scatter, ctx.gather, ctx.group, ctx.tag = scatter, gather, group, tag
        return comm.all_to_all(x, scatter, gather, group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        return comm.all_to_all(g, ctx.gather, ctx.scatter, ctx.group, direction="bwd", tag=ctx.tag), None, None, None, None


class _SplitContext(torch.autograd.Function):
    """Keep this rank's contiguous chunk of dim 1 (fwd) / zero-pad its gradient back (bwd)."""

    @staticmethod
    def forward(ctx, x, group):
        world = comm.group_size(group)
        ctx.full, ctx.rank = x.shape[SEQ_DIM], comm.group_rank(group)
        if ctx.full % world:
            raise ValueError(f"cannot split {ctx.full} tokens over {world} context-parallel ranks")
        n = ctx.full // world
        # a copy, never a view: a view (micro-batch 1) would keep the whole (B, N, D) input alive
        return x.narrow(SEQ_DIM, ctx.rank * n, n).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, g):
        n = g.shape[SEQ_DIM]
        pad = [0, 0] * (g.dim() - 1 - SEQ_DIM) + [ctx.rank * n, ctx.full - (ctx.rank + 1) * n]
        return torch.nn.functional.pad(g, pad), None


class _GatherContext(torch.autograd.Function):
    """All-gather dim 1 (fwd) / this rank's chunk of the gradient times the group size (bwd)."""

    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group = group
        return comm.all_gather(x, SEQ_DIM, group, direction="fwd", tag=tag)

    @staticmethod
    def backward(ctx, g):
        return _split(g, SEQ_DIM, ctx.group) * comm.group_size(ctx.group), None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, tag: str = "cp") -> torch.Tensor:
    """Autograd all-to-all (:func:`vitp.parallel.comm.all_to_all`): ``(.., s, .., g, ..)`` ->
    ``(.., s / world, .., g * world, ..)``; backward the transposed all-to-all."""
    return x if comm.group_size(group) == 1 else _AllToAll.apply(x, scatter_dim, gather_dim, group, tag)


def split_to_context_region(x: torch.Tensor, group) -> torch.Tensor:
    """Tokens ``(B, N, ...)`` -> this context-parallel rank's contiguous ``(B, N / cp, ...)``;
    backward zero-pads the gradient (the other tokens' gradients live on the other cp ranks and
    meet theirs in the parameter-gradient reduction over cp). No communication.

    Raises ``ValueError`` if ``N`` is not divisible by the group size.
    """
    return x if comm.group_size(group) == 1 else _SplitContext.apply(x, group)


def gather_from_context_region(x: torch.Tensor, group, tag: str = "cp_boundary") -> torch.Tensor:
    """Token shards ``(B, N / cp, ...)`` -> ``(B, N, ...)`` feeding computation every cp rank
    repeats (the loss). Backward keeps this rank's chunk of the (identical) gradient, times cp:
    the data-parallel reduction averages over ``dp * cp`` ranks while the cp shards' gradients
    are parts of one sample's gradient (Megatron-LM scales the loss by ``context_parallel_size``
    for the same reason)."""
    return x if comm.group_size(group) == 1 else _GatherContext.apply(x, group, tag)


def copy_to_tp_region(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron ``f``). Any shape."""
    return x if comm.group_size(group) == 1 else _CopyToTP.apply(x, group, tag)


def reduce_from_tp_region(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron ``g``). Any shape."""
    return x if comm.group_size(group) == 1 else _ReduceFromTP.apply(x, group, tag)


def sum_over_tp_region(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """All-reduce forward and backward: the sum of every rank's ``x`` when each rank uses the sum
    in its own (different) computation, e.g. the sum of squares of an RMSNorm whose width is
    split over the TP group (:class:`vitp.parallel.norms.TPRMSNorm`). Any shape."""
    return x if comm.group_size(group) == 1 else _SumOverTP.apply(x, group, tag)


def scatter_to_sequence_region(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """``(B, N, D)`` -> this rank's ``(B, N / tp, D)``; all-gather backward.

    Raises ``ValueError`` if ``N`` is not divisible by the group size (pad first, see
    :func:`vitp.parallel.timm_tp.sequence_parallel_enter`).
    """
    return x if comm.group_size(group) == 1 else _Scatter.apply(x, SEQ_DIM, group, tag)


def gather_from_sequence_region_to_replicated(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """``(B, N / tp, D)`` -> ``(B, N, D)`` feeding replicated computation; backward keeps this
    rank's slice of the (identical on every rank) gradient."""
    return x if comm.group_size(group) == 1 else _Gather.apply(x, SEQ_DIM, group, tag, False)


def gather_from_tp_region(x: torch.Tensor, group, partial_grad: bool = False, tag: str = "tp") -> torch.Tensor:
    """``(..., F / tp)`` -> ``(..., F)``: every rank's output features, in rank order (Megatron
    ``gather_from_tensor_model_parallel_region``, the ``gather_output`` of a column-parallel layer).

    Backward: the gathered tensor's gradient is split back to this rank's features when it is the
    same on every rank (the output feeds replicated computation); with ``partial_grad=True`` (it
    feeds computation on this rank's token shard, sequence parallelism) each rank holds a partial
    sum, so the gradient is reduce-scattered instead.
    """
    return x if comm.group_size(group) == 1 else _Gather.apply(x, -1, group, tag, partial_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group, tag: str = "tp") -> torch.Tensor:
    """Partial sums ``(B, N, D)`` -> this rank's summed ``(B, N / tp, D)``; all-gather backward."""
    return x if comm.group_size(group) == 1 else _ReduceScatter.apply(x, SEQ_DIM, group, tag)


class NoDeepcopy:
    """Mixin: deep-copying a tensor-parallel module would silently drop the parameter
    attributes (``tensor_model_parallel`` ...) and gradient hooks (``nn.Parameter.__deepcopy__``
    keeps neither) and cannot copy a process group, so it raises a clear error instead."""

    def __deepcopy__(self, memo):
        raise TypeError(f"{type(self).__name__} (tensor parallel) cannot be deep-copied: deepcopy the full model "
                        "before vitp.parallel.tensor_parallelize, or use state dicts (full_state_dict)")
