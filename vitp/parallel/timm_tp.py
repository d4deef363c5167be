"""Tensor (and sequence) parallel versions of timm's ``Attention`` and MLPs, and
:func:`tensor_parallelize`, which swaps them into a model in place.

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
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, GluMlp, Mlp, SwiGLU

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_weight,
    gather_linears,
    register_grad_allreduce,
    shard_like,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region_to_replicated,
    scatter_to_sequence_region,
)
from .partial_sync import attach_partial_sync
from .random import sharded_fork
from .state import ParallelState, _divisors


@dataclass
class SequenceInfo:
    """True token count ``N`` (before padding) of the sequence-parallel region of one model."""

    seq_len: Optional[int] = None


def _check_divisible(what: str, value: int, tp: int) -> None:
    if value % tp:
        raise ValueError(f"parallel.tp={tp} does not divide {what}={value}; valid tp degrees: {_divisors(value)}")


class TPAttention(nn.Module):
    """timm ``Attention`` over this rank's ``H / tp`` heads.

    ``forward(x, attn_mask=None, is_causal=False, token_groups=None)``: ``(B, N, D)`` ->
    ``(B, N, D)``, or with sequence parallelism ``(B, N_pad / tp, D)`` -> ``(B, N_pad / tp, D)``.
    ``attn_mask`` is for the unpadded ``N`` tokens; a per-head mask ``(B, H, N, N)`` is cut to the
    local heads. ``token_groups`` (:class:`vitp.models.TokenGroups`: ``group``/``ungroup`` of
    ``(B, N, F)`` token sequences, ``num_tokens`` = N) makes attention run within groups (spatial or temporal) of
    the full, gathered and unpadded sequence (see the module docstring); no mask then.
    Attention-probability dropout is drawn from the TP-rank-specific RNG stream, and only in
    training mode.
    """

    def __init__(self, attn: Attention, state: ParallelState, seq_info: Optional[SequenceInfo] = None):
        super().__init__()
        if not isinstance(attn, Attention):
            raise TypeError(f"expected timm.layers.Attention, got {type(attn).__name__}")
        if not isinstance(attn.norm, nn.Identity):
            raise ValueError("timm Attention(scale_norm=True) (timm Block scale_attn_norm=True) normalises over the "
                             "full attention width and is not supported with tensor parallelism")
        if getattr(attn, "gate", None) is not None:
            raise ValueError("timm Attention(gated=True) is not supported with tensor parallelism")
        _check_divisible("num_heads", attn.num_heads, state.tp_size)
        self.group, self.tp_size, self.tp_rank = state.tp_group, state.tp_size, state.tp_rank
        self.sequence_parallel = state.sequence_parallel
        self.seq_info = seq_info
        self.num_heads = attn.num_heads  # full count (timm attribute)
        self.local_heads = attn.num_heads // state.tp_size
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, state, stride_chunks=3)
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        for p in list(self.q_norm.parameters()) + list(self.k_norm.parameters()):
            register_grad_allreduce(p, state, "tp_partial_grad")  # each rank normalises only its heads
        self.attn_drop = attn.attn_drop
        self.norm = nn.Identity()
        self.proj = RowParallelLinear.from_linear(attn.proj, state)
        self.proj_drop = attn.proj_drop

    @classmethod
    def from_timm(cls, attn: Attention, state: ParallelState, seq_info: Optional[SequenceInfo] = None
                  ) -> "TPAttention":
        """Shard a full timm ``Attention`` (identical weights on all TP ranks).

        Raises
        ------
        ValueError
            ``scale_norm=True``, ``gated=True``, or ``num_heads`` not divisible by tp.
        """
        return cls(attn, state, seq_info)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                token_groups=None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, N_pad, 3 * H/tp * hd); gathers tokens under SP
        n_pad = n = qkv.shape[1]
        if self.sequence_parallel and self.seq_info is not None and self.seq_info.seq_len is not None:
            n = self.seq_info.seq_len
        elif self.sequence_parallel and token_groups is not None:
            n = token_groups.num_tokens
        if n != n_pad:
            if not 0 < n_pad - n < self.tp_size:
                raise ValueError(f"sequence parallel: {n_pad} gathered tokens for seq_len={n} at tp={self.tp_size}")
            qkv = qkv[:, :n]
        if token_groups is not None:
            if attn_mask is not None or is_causal:
                raise ValueError("attention masks are not supported with token_groups")
            qkv = token_groups.group(qkv)  # (B', N', 3 * H/tp * hd): groups of the full sequence
        bg, ng = qkv.shape[:2]
        q, k, v = qkv.reshape(bg, ng, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == self.num_heads > 1:
            h0 = self.local_heads * self.tp_rank
            attn_mask = attn_mask[:, h0:h0 + self.local_heads]
        p = self.attn_drop.p if self.training else 0.0
        with sharded_fork(p, self.training, q.device, self.tp_size):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal,
                                               scale=self.scale)
        o = o.transpose(1, 2).reshape(bg, ng, self.local_heads * self.head_dim)
        if token_groups is not None:
            o = token_groups.ungroup(o)  # (B, N, H/tp * hd)
        if n != n_pad:
            o = F.pad(o, (0, 0, 0, n_pad - n))  # pad rows: proj gives just the bias there
        o = self.proj(o)  # all-reduce, or reduce-scatter under SP
        drop = sharded_fork(self.proj_drop.p, self.training, o.device, self.tp_size) if self.sequence_parallel \
            else contextlib.nullcontext()
        with drop:
            return self.proj_drop(o)


class TPMlp(nn.Module):
    """timm ``Mlp``, ``SwiGLU``, ``GluMlp`` / ``SwiGLUPacked`` over this rank's ``hidden / tp`` units.

    ``forward``: ``(B, N, D)`` -> ``(B, N, D)``, or ``(B, N / tp, D)`` -> ``(B, N / tp, D)`` with
    sequence parallelism. The input enters the TP region once (one all-reduce in backward, or one
    all-gather forward / reduce-scatter backward under SP), even for SwiGLU's two fc1 layers.
    Dropout on hidden units (and on the output under SP) uses the TP-rank-specific RNG stream.
    """

    def __init__(self, mlp: nn.Module, state: ParallelState):
        super().__init__()
        if not isinstance(mlp, (Mlp, SwiGLU, GluMlp)):
            raise TypeError(f"expected timm Mlp, SwiGLU or GluMlp, got {type(mlp).__name__}")
        if not isinstance(mlp.norm, nn.Identity):
            raise ValueError("timm MLP with a norm_layer (timm Block scale_mlp_norm=True) normalises over all hidden "
                             "units and is not supported with tensor parallelism")
        if not isinstance(mlp.fc2, nn.Linear):
            raise ValueError("timm MLP with use_conv=True is not supported with tensor parallelism")
        tp, self.group, self.tp_size = state.tp_size, state.tp_group, state.tp_size
        self.sequence_parallel = state.sequence_parallel
        col = dict(state=state, input_comm=False)
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
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, state)
        self.drop2 = mlp.drop2
        self.input_comm = True  # False: the input is this rank's own stream (partial sync)

    @classmethod
    def from_timm(cls, mlp: nn.Module, state: ParallelState) -> "TPMlp":
        """Shard a full timm MLP. Raises ``ValueError`` for a norm layer, ``use_conv`` or hidden
        units not divisible by tp; ``TypeError`` for other MLP classes."""
        return cls(mlp, state)

    def _fc1(self, x: torch.Tensor) -> tuple:
        """fc1 output(s): gathered from the token shards once (re-gathered in backward) under SP,
        else entering the TP region once (one all-reduce of the input gradient)."""
        fcs = (self.fc1_g, self.fc1_x) if self.kind == "swiglu" else (self.fc1,)
        if self.sequence_parallel:
            return gather_linears(x, [(fc.weight, fc.bias) for fc in fcs], self.group)
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


def sequence_parallel_enter(x: torch.Tensor, state: ParallelState, seq_info: Optional[SequenceInfo] = None
                            ) -> torch.Tensor:
    """Replicated tokens ``(B, N, D)`` -> this rank's ``(B, ceil(N / tp), D)``.

    Pads ``N`` with zero tokens up to a multiple of tp and records ``N`` in ``seq_info``.
    Backward all-gathers the gradient. Identity without sequence parallelism.
    """
    if not state.sequence_parallel:
        return x
    n = x.shape[1]
    if seq_info is not None:
        seq_info.seq_len = n
    pad = (-n) % state.tp_size
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


def parallelize_block(blk: nn.Module, state: ParallelState, info: SequenceInfo,
                      replicated_skip: Sequence[str] = ()) -> None:
    """Swap ``blk.attn`` / ``blk.mlp`` for :class:`TPAttention` / :class:`TPMlp`, in place.

    With sequence parallelism every other parameter of the block (norms, LayerScale, biases; not
    the children named in ``replicated_skip``, which the caller handles) sees only this rank's
    tokens, so its gradient is summed over the TP group by a hook (``sequence_parallel=True``).

    With ``state.partial_sync < 1`` (:mod:`vitp.parallel.partial_sync`) the layers are built
    without sequence parallelism, ``qkv`` / ``fc1`` read this rank's own stream (no collective),
    ``proj`` / ``fc2`` sum only the first ``int(p * D)`` channels, and every other parameter of
    the block (and the row-parallel biases) gets its per-rank partial gradient summed over the TP
    group (``tp_partial_grad=True``).
    """
    tp_state = dataclasses.replace(state, sequence_parallel=False) if state.partial else state
    blk.attn = TPAttention.from_timm(blk.attn, tp_state, info)
    blk.mlp = TPMlp.from_timm(blk.mlp, tp_state)
    if state.partial:
        blk.mlp.input_comm = False
        attach_partial_sync([blk.attn.proj, blk.mlp.fc2], [blk.attn.qkv], state)
    elif not state.sequence_parallel:
        return
    attr = "tp_partial_grad" if state.partial else "sequence_parallel"
    skip = {"attn", "mlp", *replicated_skip}
    for name, child in blk.named_children():
        if name not in skip:
            for p in child.parameters():
                register_grad_allreduce(p, state, attr)
    for p in blk.parameters(recurse=False):
        register_grad_allreduce(p, state, attr)


def _install_vit_hooks(vit: nn.Module, state: ParallelState, info: SequenceInfo) -> None:
    blocks = list(vit.blocks)
    blocks[0].register_forward_pre_hook(lambda _m, args: (sequence_parallel_enter(args[0], state, info),) + args[1:])
    blocks[-1].register_forward_hook(lambda _m, _a, out: sequence_parallel_exit(out, state, info.seq_len))


def tensor_parallelize(model: nn.Module, state: ParallelState, seq_len: Optional[int] = None) -> nn.Module:
    """Shard every block of ``model`` whose ``attn`` and ``mlp`` are timm layers holding full
    weights (:func:`parallelize_block`), in place, and return ``model``. A no-op when
    ``state.tp_size == 1``.

    ``model`` may be a ``timm`` ``VisionTransformer`` (with ``state.sequence_parallel``, tokens
    are scattered before its first block and gathered after its last by forward hooks) or any
    module with such blocks whose sequence-parallel region the caller opens and closes itself with
    :func:`sequence_parallel_enter` / :func:`sequence_parallel_exit` (the ViT generator's plan:
    :func:`vitp.models.parallelize_generator`).

    Parameters
    ----------
    seq_len : int, optional
        True token count ``N`` (inferred at run time for a ``VisionTransformer``).

    Raises
    ------
    ValueError
        Unsupported timm options, sizes not divisible by tp, or no block found.
    """
    if state.tp_size == 1:
        return model
    if state.partial:
        raise ValueError("parallel.partial_sync < 1 needs a model plan that owns the output head "
                         "(vitp.models.parallelize_generator); tensor_parallelize supports partial_sync=1 only")
    from timm.models.vision_transformer import VisionTransformer

    blocks = [m for m in model.modules() if is_timm_block(m)]
    if not blocks:
        raise ValueError("tensor_parallelize: no block with timm `attn` and `mlp` children found")
    info = SequenceInfo(seq_len)
    for blk in blocks:
        parallelize_block(blk, state, info)
    if state.sequence_parallel:
        for vit in (m for m in model.modules() if isinstance(m, VisionTransformer)):
            _install_vit_hooks(vit, state, info)
    return model


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
