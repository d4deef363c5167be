"""The tensor / sequence / context-parallel plan of Wan (:mod:`vitp.models.wan`): :data:`WAN_PLAN`,
applied by :func:`parallelize_wan`, read by the planner through the styles' ``roles`` and
``collectives`` (:func:`vitp.parallel.plan.describe_plan`), and the tensor-parallel Wan attentions
it swaps in. The machinery is :mod:`vitp.parallel.plan`; the generator's table
(:data:`vitp.models.GENERATOR_PLAN`) is the model this one follows.

Layout (Megatron-LM, Shoeybi et al. 2019, column/row-parallel by heads and hidden units;
Korthikanti et al. 2022 sequence parallelism; as NeMo DFM's Wan bridge, whose Megatron-Core Wan
fuses q/k/v into the tensor-parallel ``linear_qkv``). Modes: ``tp`` exact tensor parallelism,
``sp`` with sequence parallelism (``partial`` sync is not planned for Wan: :func:`parallelize_wan`
refuses it). Rows, in the order they are applied:

- ``embed`` (cp): tokens split over the cp group (contiguous ``N / cp``,
  :class:`~vitp.parallel.styles.ContextEnter`), and the rotary tables ``cos``/``sin``
  ``(N, hd / 2)`` cut to the same rows (:class:`ContextRotaryRows`), so every rank rotates its
  own tokens' positions;
- ``embed`` (sp): tokens enter the sequence region (split over the TP group); the modulation
  ``mod (B, 6, D)`` enters the TP region (:class:`ModulationEnter`): every block applies it to a
  token shard, so its gradient is a per-rank partial sum, summed once here (tag ``cond``). Without
  SP it is applied to the whole replicated stream and its gradient is already whole: no row;
- ``embed``: the caption tokens ``ctx (B, L, D)`` enter the TP region (tag ``text``): every
  block's column-parallel ``kv`` leaves a partial gradient. ``temb`` needs nothing (the final
  layer runs replicated, after the sequence exit, and ``time_proj`` sits before the ``mod``
  row); ``cos``/``sin`` are not trained;
- ``blocks.*.attn``: :class:`TPWanSelfAttention` (``qkv`` column-parallel with a per-head stride
  of 3, ``proj`` row-parallel, q/k RMSNorm across all heads through :class:`~vitp.parallel.TPRMSNorm`,
  rotary per local head with the same tables);
- ``blocks.*.cross_attn``: :class:`TPWanCrossAttention` (``q``, ``kv`` stride 2 column-parallel,
  ``proj`` row-parallel, q/k RMSNorm across heads the same way);
- ``blocks.*.mlp``: hidden units split (:class:`~vitp.parallel.styles.HiddenParallelMlp`);
- ``blocks.*`` (sp): the block's replicated parameters (``scale_shift_table``, ``norm2``'s weight
  and bias) see only the rank's token shard: gradients summed over the TP group;
- ``final`` (sp): tokens leave the sequence region before the output head, which then runs
  replicated (its ``scale_shift_table`` and ``linear`` see every token: no partial gradient);
- ``blocks.*.attn`` (cp): the self-attention meets the other token shards
  (:class:`~vitp.parallel.ContextAttention`: DeepSpeed-Ulysses all-to-all, Jacobs et al. 2023, or
  ring attention, Liu et al. 2023) after its q/k norm and rotary; cross-attention needs nothing
  (queries are the rank's tokens, the caption is whole);
- ``final.linear`` (cp): the output's token shards are all-gathered for the loss.

The q/k norm weights ``(D,)`` are **sharded** like the heads (rank ``r`` holds channels
``[r D / tp, (r + 1) D / tp)``), not kept whole and sliced: each weight channel multiplies only
its own head's channel, which lives on one rank, so the gradient is complete there (no
partial-gradient all-reduce per step) and the weight is stored once across the group.

Under context parallelism every parameter sees only its rank's tokens: the gradients are summed
over ``dp x cp`` by the data-parallel reduction (:class:`vitp.config.Layout`), as for the
generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitp.parallel import ContextAttention, ParallelState, TPAttention, TPCrossAttention, TPRMSNorm
from vitp.parallel.plan import ParallelPlan, PlanReport, PlanRow, apply_plan
from vitp.parallel.random import sharded_fork
from vitp.parallel.styles import (
    Collective,
    ContextEnter,
    ContextExit,
    HeadParallelAttention,
    HeadParallelCrossAttention,
    HiddenParallelMlp,
    ParallelStyle,
    PartialGradient,
    SequenceEnter,
    SequenceExit,
    StepShape,
    TPRegionEnter,
    context_collectives,
    token_count,
)

from .wan import WanBlock, WanEmbed, WanFinal, WanSelfAttention, apply_rotary

Grid = Tuple[int, int, int]


def _sharded(dim: int, stride: int = 1) -> str:
    return f"sharded(dim={dim}, stride={stride})"


def _tp_qk_norms(attn: nn.Module, state: ParallelState) -> tuple:
    """``(q_norm, k_norm)`` as :class:`~vitp.parallel.TPRMSNorm` (weights sharded like the heads);
    the full ``nn.RMSNorm`` at tp = 1 (a context-parallel attention shards nothing)."""
    if state.tp_size == 1:
        return attn.q_norm, attn.k_norm
    return TPRMSNorm.from_rmsnorm(attn.q_norm, state), TPRMSNorm.from_rmsnorm(attn.k_norm, state)


class TPWanSelfAttention(TPAttention):
    """:class:`~vitp.models.wan.WanSelfAttention` over this rank's ``h = H / tp`` heads: ``qkv``
    column-parallel with a per-head stride of 3 (``[Q | K | V]``), ``proj`` row-parallel,
    ``q_norm``/``k_norm`` :class:`~vitp.parallel.TPRMSNorm` (RMSNorm over all ``D`` channels: the
    per-token sum of squares all-reduced over the TP group), rotary positions per local head.

    ``forward(x, cos, sin) -> same shape as x``: ``x`` ``(B, n, D)``, or with sequence parallelism
    ``(B, n_pad / tp, D)`` (``qkv`` all-gathers the token shards, ``proj`` reduce-scatters);
    ``cos``, ``sin`` ``(n, hd / 2)`` are the rotary rows of this rank's ``n`` tokens (``N``, or
    ``N / cp`` under context parallelism), whose count also tells how many gathered rows are SP
    padding. Under context parallelism (:meth:`~vitp.parallel.TPAttention.set_context`) q and k
    are normalised and rotated before the Ulysses all-to-all (which leaves a rank ``h / cp``
    heads, too few for a norm across heads) or the ring.

    Raises ``ValueError`` as :class:`~vitp.parallel.TPAttention` (heads not divisible by tp) and
    for a token count that does not match the tables.
    """

    def __init__(self, attn: WanSelfAttention, state: ParallelState, seq_len: Optional[int] = None):
        super().__init__(attn, state, seq_len)

    def _qk_norms(self, attn, state):
        return _tp_qk_norms(attn, state)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, n_pad, 3 h hd); gathers the token shards under SP
        B, n_pad, n, hd = qkv.shape[0], qkv.shape[1], cos.shape[0], self.head_dim
        if n != n_pad:
            if not (self.sequence_parallel and 0 < n_pad - n < self.tp_size):
                raise ValueError(f"TPWanSelfAttention: {n_pad} tokens for rotary tables of {n} rows "
                                 f"at tp={self.tp_size}")
            qkv = qkv[:, :n]
        q, k, v = qkv.chunk(3, dim=-1)  # (B, n, h hd)
        q, k = self.q_norm(q), self.k_norm(k)  # across all H heads: sum of squares summed over TP
        q, k, v = (t.unflatten(-1, (-1, hd)).transpose(1, 2) for t in (q, k, v))  # (B, h, n, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        back, p = None, self.attn_drop.p if self.training else 0.0
        if self.context is not None and self.context.ring(None):
            if n != self.context.local_tokens():
                raise ValueError(f"context parallel: {n} local tokens for grid {self.context.grid}")
            o = self.context.attend(q, k, v, self.scale)
        else:
            if self.context is not None:  # Ulysses: heads scattered, tokens gathered
                packed = torch.stack((q, k, v), dim=2).transpose(1, 3).reshape(B, n, -1)  # (B, n, 3 h hd)
                packed, back = self.context.enter(packed, None, hd)
                q, k, v = packed.unflatten(-1, (3, -1, hd)).permute(2, 0, 3, 1, 4).unbind(0)
            with sharded_fork(p, self.training, q.device, self.tp_size):
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.scale)
        return self._project(o.transpose(1, 2).flatten(2), back, n, n_pad)  # (B, n', h' hd)


class TPWanCrossAttention(TPCrossAttention):
    """:class:`~vitp.models.wan.WanCrossAttention` over this rank's ``H / tp`` heads
    (:class:`~vitp.parallel.TPCrossAttention`: ``q`` and ``kv`` stride 2 column-parallel, ``proj``
    row-parallel; Wan's own ``attend`` over the local heads) with ``q_norm``/``k_norm``
    :class:`~vitp.parallel.TPRMSNorm` across all heads. ``forward(x (B, n, D) or (B, n_pad / tp,
    D), ctx (B, L, D), mask=None)``; ``ctx`` entered the TP region at the embedding. Raises
    ``ValueError`` for heads not divisible by tp."""

    def _qk_norms(self, cross, state):
        return _tp_qk_norms(cross, state)


def _norm_bytes(shape: StepShape, tokens: int) -> int:
    """Bytes of one ``(micro, tokens, 1)`` sum of squares (fp32 for 16-bit activations)."""
    return shape.micro * tokens * max(4, shape.act_bytes)


def _norm_collectives(shape: StepShape, q_tokens: int, k_tokens: int) -> List[Collective]:
    """The q and k norms' all-reduces of their sums of squares, forward and backward (tag ``tp``)."""
    return [Collective("all_reduce", d, "tp", _norm_bytes(shape, n)) for d in ("fwd", "bwd")
            for n in (q_tokens, k_tokens)]


def _norm_roles(module: nn.Module) -> dict:
    return {n: _sharded(0) for norm in ("q_norm", "k_norm")
            for n, _ in getattr(module, norm).named_parameters(prefix=norm)}


@dataclass(frozen=True)
class WanHeadParallelAttention(HeadParallelAttention):
    """Wan's self-attention -> :class:`TPWanSelfAttention`: ``qkv`` sharded with stride 3, ``proj``
    row-parallel (bias partial under SP), q/k norm weights sharded like the heads; besides the
    pair of :func:`~vitp.parallel.styles.HeadParallelAttention` collectives, the two norms'
    all-reduces of ``(B, N / cp, 1)`` each way."""

    def apply(self, module, ctx):
        return TPWanSelfAttention(module, ctx.state, ctx.seq_len)

    def column_roles(self, module):
        return {**{n: _sharded(0, 3) for n, _ in module.qkv.named_parameters(prefix="qkv")}, **_norm_roles(module)}

    def collectives(self, sizes, shape):
        return super().collectives(sizes, shape) + _norm_collectives(shape, shape.local_tokens, shape.local_tokens)


@dataclass(frozen=True)
class WanHeadParallelCrossAttention(HeadParallelCrossAttention):
    """Wan's cross-attention -> :class:`TPWanCrossAttention`: ``q``, ``kv`` (stride 2) sharded,
    ``proj`` row-parallel, q/k norm weights sharded like the heads; besides the pair of
    :class:`~vitp.parallel.styles.HeadParallelCrossAttention` collectives, the norms' all-reduces
    of ``(B, N / cp, 1)`` (padded to tp under SP: pad rows query too) and ``(B, L, 1)``."""

    def apply(self, module, ctx):
        return TPWanCrossAttention(module, ctx.state)

    def column_roles(self, module):
        out = {n: _sharded(0) for n, _ in module.q.named_parameters(prefix="q")}
        out.update({n: _sharded(0, 2) for n, _ in module.kv.named_parameters(prefix="kv")})
        return {**out, **_norm_roles(module)}

    def collectives(self, sizes, shape):
        n = -(-shape.local_tokens // shape.tp) * shape.tp if shape.sequence_parallel else shape.local_tokens
        return super().collectives(sizes, shape) + _norm_collectives(shape, n, shape.text_tokens)


@dataclass(frozen=True)
class ModulationEnter(TPRegionEnter):
    """Wan's shared modulation ``mod (B, 6, D)`` (output ``output`` of the embedding) enters the TP
    region: identity forward, all-reduce of its gradient backward (tag ``cond``), once per
    micro-batch for all blocks (:class:`~vitp.parallel.styles.TPRegionEnter`)."""

    output: int = 2
    tag: str = "cond"

    def collectives(self, sizes, shape):
        nb = shape.micro * 6 * shape.width * shape.act_bytes
        return [Collective("all_reduce", "bwd", self.tag, nb, 2 if shape.pp > 1 else 1)]


@dataclass(frozen=True)
class ContextRotaryRows(ParallelStyle):
    """Outputs ``outputs`` of the module (the rotary tables ``cos``, ``sin`` ``(N, hd / 2)``, not
    trained) keep the rows of this context-parallel rank's tokens, ``[r N / cp, (r + 1) N / cp)``,
    as :class:`~vitp.parallel.styles.ContextEnter` splits the tokens. No communication. Raises
    ``ValueError`` (at forward) when cp does not divide ``N``."""

    outputs: Tuple[int, ...] = (4, 5)

    def apply(self, module, ctx):
        cp, rank = ctx.state.cp_size, ctx.state.cp_rank

        def rows(t: torch.Tensor) -> torch.Tensor:
            if t.shape[0] % cp:
                raise ValueError(f"cannot split {t.shape[0]} rotary rows over {cp} context-parallel ranks")
            n = t.shape[0] // cp
            return t[rank * n:(rank + 1) * n]

        module.register_forward_hook(
            lambda _m, _a, out: tuple(rows(t) if i in self.outputs else t for i, t in enumerate(out)))


@dataclass(frozen=True)
class WanContextAttention(ParallelStyle):
    """Wan's self-attention meets its cp group's token shards
    (:class:`~vitp.parallel.ContextAttention`, Ulysses or ring per ``state.cp_mode``); at tp = 1 it
    first becomes a :class:`TPWanSelfAttention` over the one-rank TP group (same parameters,
    nothing sharded). Collectives as :func:`~vitp.parallel.styles.context_collectives` (full
    attention)."""

    def apply(self, module, ctx):
        state, new = ctx.state, None
        if not isinstance(module, TPWanSelfAttention):
            module = new = TPWanSelfAttention(module, state, ctx.seq_len)
        module.set_context(ContextAttention(state.cp_group, state.cp_size, state.cp_mode, ctx.grid))
        return new

    def collectives(self, sizes, shape):
        return context_collectives(shape, "full")


def wan_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``[(canonical name, layer)]`` of a :class:`~vitp.models.WanModel` (``embed``, ``blocks.<i>``,
    ``final``), or of a module holding some of its layers (blocks numbered in module order)."""
    out, i = [], 0
    for m in model.modules():
        if isinstance(m, WanEmbed):
            out.append(("embed", m))
        elif isinstance(m, WanFinal):
            out.append(("final", m))
        elif isinstance(m, WanBlock):
            out.append((f"blocks.{i}", m))
            i += 1
    return out


def _final_tokens(final: nn.Module) -> int:
    return token_count(final.grid)


EXACT = ("tp", "sp")
_BLOCK_REST = ("attn", "cross_attn", "mlp")  # planned by their own rows

WAN_PLAN = ParallelPlan(
    name="wan",
    roots=("embed", "blocks", "final"),
    layers=wan_layers,
    rows=(
        PlanRow("embed", ContextEnter(output=0), EXACT, axis="cp"),
        PlanRow("embed", ContextRotaryRows(outputs=(4, 5)), EXACT, axis="cp"),
        PlanRow("embed", SequenceEnter(output=0), ("sp",)),
        PlanRow("embed", ModulationEnter(output=2, tag="cond"), ("sp",)),
        PlanRow("embed", TPRegionEnter(output=3, tag="text", caption=True), EXACT),
        PlanRow("blocks.*.attn", WanHeadParallelAttention(), EXACT),
        PlanRow("blocks.*.cross_attn", WanHeadParallelCrossAttention(), EXACT),
        PlanRow("blocks.*.mlp", HiddenParallelMlp(), EXACT),
        PlanRow("blocks.*", PartialGradient("sequence_parallel", skip=_BLOCK_REST), ("sp",)),
        PlanRow("final", SequenceExit(input=0, seq_len=_final_tokens), ("sp",)),
        PlanRow("blocks.*.attn", WanContextAttention(), EXACT, axis="cp"),
        PlanRow("final.linear", ContextExit(), EXACT, axis="cp"),
    ),
)


def parallelize_wan(model: nn.Module, state: ParallelState, seq_len: Optional[int] = None,
                    grid: Optional[Grid] = None, plan: ParallelPlan = WAN_PLAN) -> PlanReport:
    """Apply ``plan`` (:data:`WAN_PLAN`) to a Wan model in place and return the
    :class:`~vitp.parallel.plan.PlanReport`; a no-op when ``state.tp_size == state.cp_size == 1``.

    ``model``: a :class:`~vitp.models.WanModel` (or a module holding Wan layers) with full weights,
    identical on every rank. ``grid`` ``(gt, gh, gw)`` and ``seq_len`` ``N`` default to the
    embedding's / output head's grid; the model's ``set_grid`` (which its forward calls when the
    input's grid changes) keeps the parallel attentions in step afterwards.

    Raises
    ------
    ValueError
        ``parallel.partial_sync < 1`` (not planned for Wan), no :class:`~vitp.models.wan.WanBlock`,
        heads or widths not divisible by tp, no grid for a module without Wan's embedding or head
        under sequence or context parallelism, or a plan row that names no module.
    """
    if state.tp_size == 1 and state.cp_size == 1:
        return PlanReport(plan.name, "tp")
    if state.partial:
        raise ValueError("parallelize_wan: parallel.partial_sync < 1 is not planned for Wan; use partial_sync=1")
    if not any(isinstance(m, WanBlock) for m in model.modules()):
        raise ValueError("parallelize_wan: the model holds no WanBlock")
    grids = [m.grid for m in model.modules() if isinstance(m, (WanEmbed, WanFinal))]
    grid = tuple(grid) if grid is not None else tuple(grids[0]) if grids else None
    if seq_len is None and grid is not None:
        seq_len = token_count(grid)
    if (state.sequence_parallel or state.cp_size > 1) and grid is None:
        raise ValueError("parallelize_wan: sequence and context parallelism need the token grid; pass "
                         "grid=(gt, gh, gw) for a module without Wan's embedding or output head")
    return apply_plan(model, plan, state, seq_len, grid)
