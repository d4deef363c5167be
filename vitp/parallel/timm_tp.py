"""Tensor (and sequence) parallel versions of timm's ``Attention`` and MLPs, and the token
scatter/gather at the edges of a sequence-parallel region. Which modules of a model become
these is the model's plan (:mod:`vitp.parallel.plan`).

Layout (Shoeybi et al. 2019, §3; Megatron-Core ``transformer/attention.py``, ``transformer/mlp.py``):

- attention: ``qkv`` column-parallel **by heads** (timm packs ``[Q all heads | K all heads |
  V all heads]``, so each of the three chunks is split separately; a contiguous split of the
  ``3 D`` rows would mix Q, K and V of different heads), local
  ``F.scaled_dot_product_attention`` over ``H / tp`` heads, ``proj`` row-parallel.
- MLP: ``fc1`` (or ``fc1_g``/``fc1_x``; or both halves of a packed GLU ``fc1``) column-parallel,
  ``fc2`` row-parallel.

Submodule names are timm's (``qkv``, ``q_norm``, ``proj``, ``fc1`` ...), so state-dict keys do not
change; :func:`full_state_dict` gathers a timm-layout state dict back.

Sequence parallelism (Korthikanti et al. 2022): between blocks and around attention/MLP, each TP
rank holds ``ceil(N / tp)`` tokens (``(B, N_pad / tp, D)``). When ``N`` is not a multiple of
``tp``, :func:`sequence_parallel_enter` pads the token dimension with zeros at the end; attention
drops the pad tokens before attending (they are never keys or queries), token-wise layers just
carry them, and :func:`sequence_parallel_exit` cuts them off, so their gradient is zero and the
result equals the unpadded model.

Factorized (space/time) attention composes with SP inside :class:`TPAttention`. A block may call
``attn(x, token_groups=groups)`` with an object that regroups a ``(t, h, w)``-ordered sequence
(``group``/``ungroup``/``num_tokens``, e.g. :class:`vitp.models.layers.TokenGroups`);
regrouping needs the whole ``(t, h, w)`` grid, which no rank holds outside attention, so
``TPAttention.forward`` does, in order:

1. ``qkv`` (column parallel): all-gather the token shards (SP) -> ``(B, N_pad, 3 H/tp hd)``;
2. drop the ``N_pad - N`` pad rows, then ``token_groups.group``: ``(B*gt, gh*gw, .)`` (spatial)
   or ``(B*gh*gw, gt, .)`` (temporal) -- a reshape/transpose of local columns, no communication;
3. attention over the local heads within each group;
4. ``token_groups.ungroup`` back to ``(B, N, H/tp hd)``, re-pad to ``N_pad`` rows;
5. ``proj`` (row parallel): reduce-scatter back to the token shards (SP).

So a factorized block moves exactly what a full block moves: one all-gather and one
reduce-scatter around attention (forward; their transposes in backward), or without SP the same
single all-reduce. Regrouping the ``qkv`` output instead of the block input is exact because
``qkv`` and ``proj`` are token-wise. Without tensor parallelism the timm attention regroups its
input instead (:class:`vitp.models.GridAttention`), which is the same computation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, GluMlp, Mlp, SwiGLU

from vitp.utils import divisors

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_weight,
    gather_columns,
    register_grad_allreduce,
    shard_like,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region_to_replicated,
    scatter_to_sequence_region,
)
from .partial_sync import partial_sync_of
from .random import sharded_fork
from .state import ParallelState


def _check_divisible(what: str, value: int, tp: int) -> None:
    if value % tp:
        raise ValueError(f"parallel.tp={tp} does not divide {what}={value}; valid tp degrees: {divisors(value)}")


def replicated_qk_norms(attn: nn.Module, state: ParallelState) -> tuple:
    """``(attn.q_norm, attn.k_norm)`` kept whole on every TP rank: per-head norms (timm's
    ``qk_norm``), of which each rank applies the weights to its own heads only, so their gradients
    are per-rank partial sums, summed over the TP group (``tp_partial_grad``)."""
    for p in list(attn.q_norm.parameters()) + list(attn.k_norm.parameters()):
        register_grad_allreduce(p, state, "tp_partial_grad")
    return attn.q_norm, attn.k_norm


class TPAttention(nn.Module):
    """timm ``Attention`` over this rank's ``H / tp`` heads: ``qkv`` column-parallel with a
    per-head stride of 3 (``[Q | K | V]``), ``proj`` row-parallel, q/k-norm weights replicated
    with a per-rank partial gradient (each rank normalises only its heads).

    ``forward(x, attn_mask=None, is_causal=False, token_groups=None)``: ``(B, N, D)`` ->
    ``(B, N, D)``, or with sequence parallelism ``(B, N_pad / tp, D)`` -> ``(B, N_pad / tp, D)``.
    ``attn_mask`` is for the unpadded ``N`` tokens; a per-head mask ``(B, H, N, N)`` is cut to the
    local heads. ``token_groups`` (:class:`vitp.models.TokenGroups`: ``group``/``ungroup`` of
    ``(B, N, F)`` token sequences, ``num_tokens`` = N) makes attention run within groups (spatial
    or temporal) of the full, gathered and unpadded sequence (see the module docstring); no mask
    then. Attention-probability dropout is drawn from the TP-rank-specific RNG stream, and only in
    training mode.

    ``seq_len``: the true token count ``N`` under sequence parallelism (the gathered sequence
    holds ``N`` padded to a multiple of tp); :meth:`set_grid` updates it when the token grid
    changes. ``partial``: partially synchronized activations (:mod:`vitp.parallel.partial_sync`,
    ``state.partial_sync < 1``): ``qkv`` reads this rank's own stream (no collective, no token
    sharding) and ``proj`` sums only its first ``int(p D)`` output channels.

    Raises ``TypeError`` for another class, ``ValueError`` for ``scale_norm=True``,
    ``gated=True``, or ``num_heads`` not divisible by tp.
    """

    def __init__(self, attn: Attention, state: ParallelState, seq_len: Optional[int] = None, partial: bool = False):
        super().__init__()
        if not isinstance(attn, Attention):
            raise TypeError(f"expected timm.layers.Attention, got {type(attn).__name__}")
        if not isinstance(attn.norm, nn.Identity):
            raise ValueError("timm Attention(scale_norm=True) (timm Block scale_attn_norm=True) normalises over the "
                             "full attention width and is not supported with tensor parallelism")
        if getattr(attn, "gate", None) is not None:
            raise ValueError("timm Attention(gated=True) is not supported with tensor parallelism")
        _check_divisible("num_heads", attn.num_heads, state.tp_size)
        layer_state = dataclasses.replace(state, sequence_parallel=False) if partial else state
        self.group, self.tp_size, self.tp_rank = state.tp_group, state.tp_size, state.tp_rank
        self.sequence_parallel = layer_state.sequence_parallel
        self.seq_len = seq_len
        self.num_heads = attn.num_heads  # full count (timm attribute)
        self.local_heads = attn.num_heads // state.tp_size
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, layer_state, stride_chunks=3, input_comm=not partial)
        self.q_norm, self.k_norm = self._qk_norms(attn, state)
        self.attn_drop = attn.attn_drop
        self.norm = nn.Identity()
        self.proj = RowParallelLinear.from_linear(attn.proj, layer_state,
                                                  partial_sync=partial_sync_of(attn.proj.out_features, state)
                                                  if partial else None)
        self.proj_drop = attn.proj_drop
        self.context = None  # a vitp.parallel.context.ContextAttention under context parallelism

    def _qk_norms(self, attn: nn.Module, state: ParallelState) -> tuple:
        """``(q_norm, k_norm)`` of the sharded module (:func:`replicated_qk_norms`); a subclass
        whose norms span all heads returns tensor-parallel ones instead."""
        return replicated_qk_norms(attn, state)

    def set_context(self, context) -> None:
        """Attend with the other token shards of a context-parallel group
        (:class:`vitp.parallel.context.ContextAttention`); the input then holds ``N / cp`` tokens
        (``N / (cp tp)`` under sequence parallelism). Raises ``ValueError`` with an attention mask."""
        self.context = context
        if self.seq_len is not None and context.grid is None:
            raise ValueError("set_context: give the ContextAttention the token grid")
        if context.grid is not None:
            self.seq_len = context.local_tokens()

    @classmethod
    def from_timm(cls, attn: Attention, state: ParallelState, seq_len: Optional[int] = None,
                  partial: bool = False) -> "TPAttention":
        """Shard a full timm ``Attention`` (identical weights on all TP ranks); see the class doc."""
        return cls(attn, state, seq_len, partial)

    def set_grid(self, grid: Sequence[int]) -> None:
        """The token grid ``(gt, gh, gw)`` of the next steps: ``seq_len = gt * gh * gw`` (over cp
        under context parallelism)."""
        self.seq_len = math.prod(int(g) for g in grid)
        if self.context is not None:
            self.context.set_grid(grid)
            self.seq_len = self.context.local_tokens()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                token_groups=None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, N_pad, 3 * H/tp * hd); gathers tokens under SP
        n_pad = n = qkv.shape[1]
        if self.sequence_parallel and self.seq_len is not None:
            n = self.seq_len
        elif self.sequence_parallel and token_groups is not None:
            n = token_groups.num_tokens
        if n != n_pad:
            if not 0 < n_pad - n < self.tp_size:
                raise ValueError(f"sequence parallel: {n_pad} gathered tokens for seq_len={n} at tp={self.tp_size}")
            qkv = qkv[:, :n]
        if (token_groups is not None or self.context is not None) and (attn_mask is not None or is_causal):
            raise ValueError("attention masks are not supported with token_groups or context parallelism")
        back = token_groups.ungroup if token_groups is not None else None
        if self.context is not None:  # the other token shards (vitp.parallel.context)
            qkv, back = self.context.enter(qkv, token_groups, self.head_dim)
        elif token_groups is not None:
            qkv = token_groups.group(qkv)  # (B', N', 3 * H/tp * hd): groups of the full sequence
        bg, ng = qkv.shape[:2]
        heads = qkv.shape[-1] // (3 * self.head_dim)  # H/tp, or H/(tp cp) under Ulysses
        q, k, v = qkv.reshape(bg, ng, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == self.num_heads > 1:
            h0 = self.local_heads * self.tp_rank
            attn_mask = attn_mask[:, h0:h0 + self.local_heads]
        p = self.attn_drop.p if self.training else 0.0
        if self.context is not None and self.context.ring(token_groups):
            o = self.context.attend(q, k, v, self.scale)
        else:
            with sharded_fork(p, self.training, q.device, self.tp_size):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal,
                                                   scale=self.scale)
        return self._project(o.transpose(1, 2).reshape(bg, ng, heads * self.head_dim), back, n, n_pad)

    def _project(self, o: torch.Tensor, back, n: int, n_pad: int) -> torch.Tensor:
        """Attention output ``o`` (grouped or context-parallel layout; ``back`` undoes it) through the
        row-parallel ``proj`` and dropout, padded back from ``n`` to the ``n_pad`` gathered rows."""
        if back is not None:
            o = back(o)  # (B, N, H/tp * hd)
        if n != n_pad:
            o = F.pad(o, (0, 0, 0, n_pad - n))  # pad rows: proj gives just the bias there
        o = self.proj(o)  # all-reduce, or reduce-scatter under SP
        drop = sharded_fork(self.proj_drop.p, self.training, o.device, self.tp_size) if self.sequence_parallel \
            else contextlib.nullcontext()
        with drop:
            return self.proj_drop(o)


class TPMlp(nn.Module):
    """timm ``Mlp``, ``SwiGLU``, ``GluMlp`` / ``SwiGLUPacked`` over this rank's ``hidden / tp``
    units: ``fc1`` (``fc1_g``/``fc1_x``; both halves of a packed GLU ``fc1``) column-parallel,
    ``fc2`` row-parallel.

    ``forward``: ``(B, N, D)`` -> ``(B, N, D)``, or ``(B, N / tp, D)`` -> ``(B, N / tp, D)`` with
    sequence parallelism. The input enters the TP region once (one all-reduce in backward, or one
    all-gather forward / reduce-scatter backward under SP), even for SwiGLU's two fc1 layers.
    Dropout on hidden units (and on the output under SP) uses the TP-rank-specific RNG stream.
    ``partial``: as :class:`TPAttention` (``fc1`` reads this rank's stream; ``fc2`` sums
    ``int(p D)`` channels).

    Raises ``TypeError`` for other MLP classes, ``ValueError`` for a norm layer, ``use_conv`` or
    hidden units not divisible by tp.
    """

    def __init__(self, mlp: nn.Module, state: ParallelState, partial: bool = False):
        super().__init__()
        if not isinstance(mlp, (Mlp, SwiGLU, GluMlp)):
            raise TypeError(f"expected timm Mlp, SwiGLU or GluMlp, got {type(mlp).__name__}")
        if not isinstance(mlp.norm, nn.Identity):
            raise ValueError("timm MLP with a norm_layer (timm Block scale_mlp_norm=True) normalises over all hidden "
                             "units and is not supported with tensor parallelism")
        if not isinstance(mlp.fc2, nn.Linear):
            raise ValueError("timm MLP with use_conv=True is not supported with tensor parallelism")
        layer_state = dataclasses.replace(state, sequence_parallel=False) if partial else state
        tp, self.group, self.tp_size = state.tp_size, state.tp_group, state.tp_size
        self.sequence_parallel = layer_state.sequence_parallel
        col = dict(state=layer_state, input_comm=False)
        if isinstance(mlp, SwiGLU):
            self.kind = "swiglu"
            _check_divisible("MLP hidden units", mlp.fc1_x.out_features, tp)
            self.fc1_g = ColumnParallelLinear.from_linear(mlp.fc1_g, **col)
            self.fc1_x = ColumnParallelLinear.from_linear(mlp.fc1_x, **col)
        elif isinstance(mlp, GluMlp):
            self.kind, self.gate_last = "glu", mlp.gate_last
            if mlp.chunk_dim != -1:
                raise ValueError("timm GluMlp with use_conv=True is not supported with tensor parallelism")
            _check_divisible("MLP hidden units", mlp.fc1.out_features // 2, tp)
            # packed fc1 = [x1 | x2] (forward: x1, x2 = fc1(x).chunk(2)): split each half
            self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, stride_chunks=2, **col)
        else:
            self.kind = "mlp"
            _check_divisible("MLP hidden units", mlp.fc1.out_features, tp)
            self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, **col)
        self.act, self.drop1, self.norm = mlp.act, mlp.drop1, nn.Identity()
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, layer_state,
                                                 partial_sync=partial_sync_of(mlp.fc2.out_features, state)
                                                 if partial else None)
        self.drop2 = mlp.drop2
        self.input_comm = not partial  # False: the input is this rank's own stream (partial sync)

    @classmethod
    def from_timm(cls, mlp: nn.Module, state: ParallelState, partial: bool = False) -> "TPMlp":
        """Shard a full timm MLP (identical weights on all TP ranks); see the class doc."""
        return cls(mlp, state, partial)

    def _fc1(self, x: torch.Tensor) -> tuple:
        """fc1 output(s): gathered from the token shards once (re-gathered in backward) under SP,
        else entering the TP region once (one all-reduce of the input gradient)."""
        fcs = (self.fc1_g, self.fc1_x) if self.kind == "swiglu" else (self.fc1,)
        if self.sequence_parallel:
            return gather_columns(x, fcs, self.group)  # with their LoRA adapters, if any
        if self.input_comm:
            x = copy_to_tp_region(x, self.group)
        return tuple(fc(x) for fc in fcs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fc1(x)
        if self.kind == "swiglu":
            h = self.act(out[0]) * out[1]
        elif self.kind == "glu":
            x1, x2 = out[0].chunk(2, dim=-1)
            h = x1 * self.act(x2) if self.gate_last else self.act(x1) * x2
        else:
            h = self.act(out[0])
        with sharded_fork(getattr(self.drop1, "p", 0.0), self.training, h.device, self.tp_size):
            h = self.drop1(h)
        y = self.fc2(self.norm(h))
        drop = sharded_fork(getattr(self.drop2, "p", 0.0), self.training, y.device, self.tp_size) \
            if self.sequence_parallel else contextlib.nullcontext()
        with drop:
            return self.drop2(y)


def sequence_parallel_enter(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Replicated tokens ``(B, N, D)`` -> this rank's ``(B, ceil(N / tp), D)``.

    Pads ``N`` with zero tokens up to a multiple of tp. Backward all-gathers the gradient.
    Identity without sequence parallelism.
    """
    if not state.sequence_parallel:
        return x
    pad = (-x.shape[1]) % state.tp_size
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return scatter_to_sequence_region(x, state.tp_group, tag="sp_boundary")


def sequence_parallel_exit(x: torch.Tensor, state: ParallelState, seq_len: Optional[int] = None) -> torch.Tensor:
    """This rank's ``(B, N_pad / tp, D)`` -> replicated ``(B, seq_len, D)`` (padding removed).

    The result feeds replicated computation, so backward keeps this rank's slice of the
    gradient (no communication). Identity without sequence parallelism.
    """
    if not state.sequence_parallel:
        return x
    x = gather_from_sequence_region_to_replicated(x, state.tp_group, tag="sp_boundary")
    return x if seq_len is None else x[:, :seq_len]


def is_timm_block(m: nn.Module) -> bool:
    """True for a module with a timm ``Attention`` as ``attn`` and a timm MLP as ``mlp``."""
    mlp = getattr(m, "mlp", None)
    return isinstance(getattr(m, "attn", None), Attention) and isinstance(mlp, (Mlp, SwiGLU, GluMlp))


def full_state_dict(model: nn.Module, state: ParallelState) -> Dict[str, torch.Tensor]:
    """timm-layout state dict with full tensors (sharded ones gathered over the TP group).
    Collective: every TP rank must call it."""
    return {k: full_weight(v, state) for k, v in model.state_dict(keep_vars=True).items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: Dict[str, torch.Tensor], state: ParallelState) -> None:
    """Copy a full timm-layout state dict into a (possibly) tensor-parallel model, slicing the
    sharded tensors. Raises ``KeyError`` for a missing key."""
    for k, v in model.state_dict(keep_vars=True).items():
        v.copy_(shard_like(v, full[k].to(v.dtype), state))


class TPCrossAttention(nn.Module):
    """A cross-attention from tokens to caption tokens (``q``, packed ``kv`` ``[K | V]``,
    ``q_norm`` / ``k_norm``, ``proj``, and an ``attend(q, kv, mask)`` method over any head count,
    as :class:`vitp.models.CrossAttention`, PixArt-alpha's ``MultiHeadCrossAttention``) over this
    rank's ``H / tp`` heads, split as NeMo's DiT cross-attention (NVIDIA/NeMo
    ``nemo/collections/diffusion/models/dit/dit_layer_spec.py``): ``q`` and ``kv`` column-parallel
    (``kv`` with a per-head stride of 2), ``proj`` row-parallel.

    ``forward(x, ctx (B, L, D), mask (B, L) or None)``: ``x`` ``(B, N, D)`` -> ``(B, N, D)``, or with
    sequence parallelism ``(B, N_pad / tp, D)`` -> ``(B, N_pad / tp, D)`` (``q`` all-gathers
    the token shards, ``proj`` reduce-scatters; pad rows only ever query). ``ctx`` is the same on
    every TP rank and already inside the TP region: ``kv``'s input gradient stays a per-rank
    partial sum that the plan sums once per micro-batch where the caption enters
    (:class:`vitp.parallel.styles.TPRegionEnter`). Under context parallelism nothing changes:
    queries are this rank's tokens, the caption is whole on every rank. ``partial``: as
    :class:`TPAttention` (``q`` reads this rank's own stream; ``proj`` sums ``int(p D)``
    channels).

    Raises ``ValueError`` when ``num_heads`` is not divisible by tp.
    """

    def __init__(self, cross: nn.Module, state: ParallelState, partial: bool = False):
        super().__init__()
        _check_divisible("num_heads", cross.num_heads, state.tp_size)
        layer_state = dataclasses.replace(state, sequence_parallel=False) if partial else state
        self.tp_size, self.sequence_parallel = state.tp_size, layer_state.sequence_parallel
        self.num_heads, self.head_dim, self.scale = cross.num_heads, cross.head_dim, cross.scale
        self._attend = type(cross).attend  # the model's own attention over the local heads
        self.q = ColumnParallelLinear.from_linear(cross.q, layer_state, input_comm=not partial)
        self.kv = ColumnParallelLinear.from_linear(cross.kv, layer_state, stride_chunks=2, sequence_parallel=False,
                                                   input_comm=False)
        self.q_norm, self.k_norm = self._qk_norms(cross, state)
        self.attn_drop = cross.attn_drop
        self.proj = RowParallelLinear.from_linear(cross.proj, layer_state,
                                                  partial_sync=partial_sync_of(cross.proj.out_features, state)
                                                  if partial else None)
        self.proj_drop = cross.proj_drop

    def _qk_norms(self, cross: nn.Module, state: ParallelState) -> tuple:
        """As :meth:`TPAttention._qk_norms`."""
        return replicated_qk_norms(cross, state)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, kv = self.q(x), self.kv(ctx)  # (B, N_pad, H/tp hd), (B, L, 2 H/tp hd)
        with sharded_fork(self.attn_drop.p, self.training, q.device, self.tp_size):
            o = self.proj(self._attend(self, q, kv, mask))
        drop = sharded_fork(self.proj_drop.p, self.training, o.device, self.tp_size) if self.sequence_parallel \
            else contextlib.nullcontext()
        with drop:
            return self.proj_drop(o)
