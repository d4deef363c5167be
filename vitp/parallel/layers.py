"""Column- and row-parallel linear layers built by slicing an existing full ``nn.Linear``.

Shoeybi et al. 2019 ("Megatron-LM", §3): an MLP ``Y = act(X A) B`` is split by columns of ``A``
(each rank computes ``act(X A_i)`` on its hidden units, no communication) and rows of ``B`` (each
rank computes a partial ``act(X A_i) B_i``; one all-reduce sums them). Self-attention is split
the same way by heads. Reference: Megatron-Core ``tensor_parallel/layers.py``
(``ColumnParallelLinear``, ``RowParallelLinear``). With sequence parallelism (Korthikanti et al.
2022) the column-parallel input is all-gathered from the token shards and the row-parallel output
is reduce-scattered back to them.

Every rank holds the same full weights (built from one seed) and keeps its
slice, so the sharded model equals the full one at any tp. Sharded parameters carry
``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride`` (DeepSpeed's grad norm
counts such parameters on every TP rank, the others on TP rank 0 only). Replicated parameters
whose gradient is a per-rank partial sum get a gradient hook that all-reduces it over the TP
group (attribute ``sequence_parallel=True`` or ``tp_partial_grad=True``).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .grads import defer_grad_allreduce
from .mappings import (
    SEQ_DIM,
    NoDeepcopy,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from .random import sharded_fork
from .state import ParallelState


def shard_tensor(full: torch.Tensor, dim: int, stride: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``.

    With ``stride > 1`` the dimension holds ``stride`` equal fused chunks (timm's qkv is
    ``[Q | K | V]``, each ``(H * hd)`` rows with heads contiguous; a packed GLU fc1 is
    ``[half 1 | half 2]``) and each chunk is split separately, so rank ``r`` gets
    ``cat(chunk_c[r-th slice] for c)``: for qkv that is ``W.view(3, H, hd, D)[:, heads_of_rank]``.

    Raises
    ------
    ValueError
        If ``full.shape[dim]`` is not divisible by ``stride * tp_size``.
    """
    size = full.shape[dim]
    if size % (stride * tp_size):
        raise ValueError(f"cannot shard size {size} (dim {dim}) into {stride} chunk(s) x tp={tp_size}")
    pieces = [c.chunk(tp_size, dim)[tp_rank] for c in full.chunk(stride, dim)]
    return torch.cat(pieces, dim).contiguous()


def unshard_parts(parts: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` given every rank's slice in rank order."""
    chunks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([chunks[r][c] for c in range(stride) for r in range(len(parts))], dim)


def full_weight(param: torch.Tensor, state: ParallelState, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gather a sharded parameter (or ``tensor`` laid out like it, e.g. ``param.grad``) back to
    the full timm layout; replicated parameters are returned as they are.

    Collective over the TP group when ``param.tensor_model_parallel``: every TP rank must call it.
    """
    t = (param.detach() if tensor is None else tensor.detach())
    if not getattr(param, "tensor_model_parallel", False) or state.tp_size == 1:
        return t
    dim, stride = param.partition_dim, param.partition_stride
    gathered = comm.all_gather(t, dim, state.tp_group, tag="export")
    return unshard_parts(list(gathered.chunk(state.tp_size, dim)), dim, stride)


def shard_like(param: torch.Tensor, full: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's slice of a full (timm-layout) tensor for ``param`` (identity if replicated)."""
    if not getattr(param, "tensor_model_parallel", False) or state.tp_size == 1:
        return full
    return shard_tensor(full, param.partition_dim, param.partition_stride, state.tp_size, state.tp_rank)


def _mark_sharded(p: nn.Parameter, dim: int, stride: int) -> None:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride


def register_grad_allreduce(param: nn.Parameter, state: ParallelState, attr: str = "sequence_parallel") -> None:
    """Mark ``param`` (``setattr(param, attr, True)``) and sum its gradient over the TP group
    with a tensor hook, once per backward (before accumulation into ``.grad``). Idempotent.

    Used for replicated parameters that see only part of the data on each TP rank: norm weights,
    LayerScale gammas and row-parallel biases in a sequence-parallel region, and q/k-norm
    weights applied to a subset of heads. With ``state.defer_grad_sync`` no hook is installed:
    the parameter is marked for :func:`vitp.parallel.grads.sync_partial_grads`, which the caller
    runs once per optimizer step (the trainer does, before the grad norm).
    """
    if state.tp_size == 1:  # nothing to sum (e.g. a context-parallel attention at tp = 1)
        return
    setattr(param, attr, True)
    if getattr(param, "_vitp_grad_allreduce", False):
        return
    if state.defer_grad_sync:  # summed once per step by vitp.parallel.grads.sync_partial_grads
        defer_grad_allreduce(param, state.tp_group)
        return
    param._vitp_grad_allreduce = True
    group = state.tp_group
    param.register_hook(lambda g: comm.all_reduce(g.clone(), group, direction="bwd", tag="param_grad"))


class _GatherLinears(torch.autograd.Function):
    """All-gather the token shards, then ``k`` linears on the gathered tokens; the backward pass
    all-gathers the shard again for the weight gradients instead of saving the gathered input,
    and reduce-scatters the summed input gradient; both collectives run asynchronously, the
    re-gather under the input-gradient matmuls, the reduce-scatter under the weight-gradient
    ones (Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication`` with
    ``sequence_parallel``; Korthikanti et al. 2022 §4.2.2: activation memory of the
    column-parallel inputs drops by tp)."""

    @staticmethod
    def forward(ctx, x, group, tag, *params):
        ctx.group, ctx.tag = group, tag
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        total = comm.all_gather(x, SEQ_DIM, group, direction="fwd", tag=tag)
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        pending = comm.all_gather(x, SEQ_DIM, ctx.group, direction="bwd", tag=ctx.tag, async_op=True)  # re-gather
        grad_in = None  # overlaps the re-gather: needs only the weights
        for g, w in zip(grads, weights):
            if g is not None:
                gi = g.matmul(w)
                grad_in = gi if grad_in is None else grad_in + gi
        reduced = comm.reduce_scatter(grad_in, SEQ_DIM, ctx.group, direction="bwd", tag=ctx.tag, async_op=True)
        total = pending.wait()
        flat, out = total.reshape(-1, total.shape[-1]), []
        for g, has_bias in zip(grads, ctx.has_bias):  # weight gradients overlap the reduce-scatter
            if g is None:
                out += [None, None]
                continue
            g2 = g.reshape(-1, g.shape[-1])
            out += [g2.t().mm(flat), g2.sum(0) if has_bias else None]
        return (reduced.wait(), None, None, *out)


def gather_linears(x: torch.Tensor, linears, group, tag: str = "tp") -> tuple:
    """``x`` ``(B, N / tp, in)`` (this rank's token shard) -> ``tuple(F.linear(all_gather(x), W, b))``
    ``(B, N, out_k)`` for each ``(W, b)`` in ``linears`` (column-parallel shards reading one
    input), with the gathered input re-gathered in backward instead of saved (:class:`_GatherLinears`)."""
    params = [t for w, b in linears for t in (w, b)]
    if comm.group_size(group) == 1:
        return tuple(F.linear(x, w, b) for w, b in linears)
    return _GatherLinears.apply(x, group, tag, *params)


def has_lora(linear: nn.Module) -> bool:
    """Whether ``linear`` carries a LoRA adapter (:func:`vitp.parallel.lora.attach_lora`)."""
    return getattr(linear, "lora_A", None) is not None


def lora_input(linear: nn.Module, x: torch.Tensor, tp_local: bool) -> torch.Tensor:
    """``x`` through the adapter's dropout (peft: ``lora_B(lora_A(dropout(x)))``); ``tp_local``: ``x``
    differs per TP rank (a row-parallel input, a token shard), so the mask is drawn from the
    TP-rank stream (:func:`vitp.parallel.random.sharded_fork`), else from the stream every TP rank shares."""
    drop = linear.lora_dropout
    if drop.p == 0 or not linear.training:
        return x
    with sharded_fork(drop.p, True, x.device, comm.group_size(linear.group) if tp_local else 1):
        return drop(x)


def lora_up(linear: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The adapter's output ``scaling * B h`` of ``h = A x`` ``(..., n_t r)`` laid out like the
    linear's local output ``(..., out_local)``: piece ``j`` of the ``n_t`` targeted pieces
    (``linear.lora_pieces``, of ``linear.lora_num_pieces`` fused ones) reads its own ``r`` columns
    of ``h`` and writes only its own piece's rows; the other pieces get zeros (block-diagonal)."""
    r, pieces, n = linear.lora_rank, linear.lora_pieces, linear.lora_num_pieces
    B = linear.lora_B  # (n_t out_piece_local, r)
    if len(pieces) == 1 and n == 1:
        return F.linear(h, B) * linear.lora_scaling
    out_piece = B.shape[0] // len(pieces)
    per = torch.einsum("...jr,jor->...jo", h.unflatten(-1, (len(pieces), r)), B.view(len(pieces), out_piece, r))
    per = per * linear.lora_scaling
    if len(pieces) == n:
        return per.flatten(-2)
    zero = per.new_zeros(*per.shape[:-2], out_piece)
    parts = {p: per[..., j, :] for j, p in enumerate(pieces)}
    return torch.cat([parts.get(i, zero) for i in range(n)], dim=-1)


def gather_columns(x: torch.Tensor, columns, group) -> tuple:
    """``(y_k)`` of column-parallel linears ``columns`` reading one token-sharded input ``x``
    ``(B, N / tp, in)`` under sequence parallelism, each with its LoRA adapter: the adapter's ``A``
    rides along as one more linear of the same gathered input (:func:`gather_linears`: one
    all-gather, the input gradients of base and adapter summed before one reduce-scatter). With
    LoRA dropout active, the adapters read their own gather of the dropped-out shard."""
    dropout = any(has_lora(c) and c.lora_dropout.p > 0 and c.training for c in columns)
    pairs = []
    for c in columns:
        pairs.append((c.weight, c.bias))
        if has_lora(c) and not dropout:
            pairs.append((c.lora_A, None))
    outs, i, res = gather_linears(x, pairs, group), 0, []
    for c in columns:
        y = outs[i]
        i += 1
        if has_lora(c):
            if dropout:
                h = gather_linears(lora_input(c, x, True), [(c.lora_A, None)], group)[0]
            else:
                h, i = outs[i], i + 1
            y = y + lora_up(c, h)
        res.append(y)
    return tuple(res)


def _new_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(data.detach().clone(), requires_grad=like.requires_grad)


class ColumnParallelLinear(NoDeepcopy, nn.Module):
    """``y = x A^T + b`` with ``A``'s output features (rows) split over the TP group.

    ``forward``: ``(B, N, in)`` (or ``(B, N / tp, in)`` with sequence parallelism) ->
    ``(B, N, out / tp)``, or with ``gather_output`` ``(..., out)`` (all-gathered). Use
    :meth:`from_linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int, out_features: int,
                 state: ParallelState, stride: int = 1, sequence_parallel: Optional[bool] = None,
                 input_comm: bool = True, gather_output: bool = False, partial_output_grad: bool = False,
                 tag: str = "tp"):
        super().__init__()
        if gather_output and stride != 1:
            raise ValueError("gather_output needs stride 1 (a gathered strided output would be reordered)")
        self.in_features, self.out_features, self.stride = in_features, out_features, stride
        self.input_comm, self.gather_output, self.partial_output_grad, self.tag = \
            input_comm, gather_output, partial_output_grad, tag
        self.sequence_parallel = state.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.group = state.tp_group
        self.weight = weight
        self.bias = bias
        if state.tp_size > 1:  # at tp = 1 (a context-parallel attention) nothing is sharded
            _mark_sharded(self.weight, 0, stride)
            if self.bias is not None:
                _mark_sharded(self.bias, 0, stride)

    @classmethod
    def from_linear(cls, linear: nn.Linear, state: ParallelState, stride_chunks: Optional[int] = None,
                    sequence_parallel: Optional[bool] = None, input_comm: bool = True, gather_output: bool = False,
                    partial_output_grad: bool = False, tag: str = "tp") -> "ColumnParallelLinear":
        """Keep this rank's output features of ``linear`` (whose weights are full and identical
        on all ranks).

        Parameters
        ----------
        stride_chunks : int, optional
            Number of fused chunks along the output features, each split separately (3 for
            timm's qkv, 2 for a packed GLU fc1). ``None`` = 1.
        sequence_parallel : bool, optional
            All-gather the token-sharded input (default: ``state.sequence_parallel``).
        input_comm : bool
            ``False`` when the caller already mapped the input into the TP region (with
            ``copy_to_tp_region`` or :func:`gather_linears`), e.g. two column layers
            reading one input (SwiGLU's ``fc1_g`` and ``fc1_x``) share one collective, or when
            the input gradient may stay a per-rank partial sum that the caller reduces later
            (the adaLN modulation: the plan reduces the conditioning's gradient once).
        gather_output : bool
            All-gather the output features (Megatron ``gather_output``): a small output (the
            adaLN modulation vector ``(B, 6 D)``) is cheaper to gather than its weight is to
            replicate. Backward splits the gradient, or reduce-scatters it with
            ``partial_output_grad`` (the output feeds a token shard).
        tag : str
            :class:`~vitp.parallel.comm.CommRecorder` tag of the output gather.

        Raises
        ------
        ValueError
            If ``out_features`` is not divisible by ``stride_chunks * tp``, or ``gather_output``
            with ``stride_chunks > 1``.
        """
        stride = stride_chunks or 1
        w = _new_param(shard_tensor(linear.weight, 0, stride, state.tp_size, state.tp_rank), linear.weight)
        b = None
        if linear.bias is not None:
            b = _new_param(shard_tensor(linear.bias, 0, stride, state.tp_size, state.tp_rank), linear.bias)
        return cls(w, b, linear.in_features, linear.out_features, state, stride, sequence_parallel, input_comm,
                   gather_output, partial_output_grad, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_comm and self.sequence_parallel:
            y = gather_columns(x, [self], self.group)[0]  # re-gathers in backward
        else:
            if self.input_comm:
                x = copy_to_tp_region(x, self.group)
            y = F.linear(x, self.weight, self.bias)
            if has_lora(self):  # A whole: h = A x is the same on every rank; B's rows are this rank's
                y = y + lora_up(self, F.linear(lora_input(self, x, False), self.lora_A))
        return gather_from_tp_region(y, self.group, self.partial_output_grad, self.tag) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), stride={self.stride}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(NoDeepcopy, nn.Module):
    """``y = x A^T + b`` with ``A``'s input features (columns) split over the TP group.

    ``forward``: ``(B, N, in / tp)`` -> ``(B, N, out)`` (all-reduce) or ``(B, N / tp, out)``
    (reduce-scatter, sequence parallelism), or with ``partial_sync`` this rank's stream update
    ``(B, N, out)`` (:class:`vitp.parallel.partial_sync.PartialSync`: only the first ``k``
    channels summed). The bias is replicated and added once, after the reduction; under sequence
    parallelism or partial sync it sees only this rank's tokens or stream, so its gradient is
    summed over the TP group (``bias.sequence_parallel`` or ``bias.tp_partial_grad``). Use
    :meth:`from_linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int, out_features: int,
                 state: ParallelState, sequence_parallel: Optional[bool] = None, partial_sync=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = state.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.group = state.tp_group
        self.weight = weight
        self.bias = bias
        self.partial_sync = partial_sync  # vitp.parallel.partial_sync.PartialSync: sum only some channels
        if state.tp_size > 1:
            _mark_sharded(self.weight, 1, 1)
        if self.bias is not None and partial_sync is not None:
            register_grad_allreduce(self.bias, state, "tp_partial_grad")
        elif self.bias is not None and self.sequence_parallel:
            register_grad_allreduce(self.bias, state, "sequence_parallel")

    @classmethod
    def from_linear(cls, linear: nn.Linear, state: ParallelState, sequence_parallel: Optional[bool] = None,
                    partial_sync=None) -> "RowParallelLinear":
        """Keep this rank's input features of ``linear``; the bias stays whole (replicated).
        ``partial_sync``: a :class:`~vitp.parallel.partial_sync.PartialSync` (sum only its first
        ``k`` output channels), or ``None`` for exact tensor parallelism.

        Raises
        ------
        ValueError
            If ``in_features`` is not divisible by tp.
        """
        w = _new_param(shard_tensor(linear.weight, 1, 1, state.tp_size, state.tp_rank), linear.weight)
        b = _new_param(linear.bias, linear.bias) if linear.bias is not None else None
        return cls(w, b, linear.in_features, linear.out_features, state, sequence_parallel, partial_sync)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if has_lora(self):  # A's columns are this rank's: a partial B A x, summed by the base's own reduction
            y = y + lora_up(self, F.linear(lora_input(self, x, True), self.lora_A))
        if self.partial_sync is not None:
            y = self.partial_sync(y)
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group)
        else:
            y = reduce_from_tp_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")
