"""LoRA adapters on vitp's linears, in every layout (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", arXiv:2106.09685): ``y = W x + b + scaling * B A x`` with ``A`` ``(r, in)``,
``B`` ``(out, r)``, ``scaling = alpha / r`` (or ``alpha / sqrt(r)``, rsLoRA, Kalajdzievski 2023,
arXiv:2312.03732), ``A`` initialised as peft's default (kaiming-uniform, ``a = sqrt(5)``) and ``B``
zero, so training starts from the base model.

The adapter lives on the linear itself, as parameters ``lora_A`` and ``lora_B`` (so the base's
keys stay as they are), with ``lora_pieces``, ``lora_num_pieces``, ``lora_rank``, ``lora_alpha``,
``lora_scaling`` and a ``lora_dropout`` module. A linear that fuses ``P`` modules along its output
rows (timm's ``qkv``, Wan's ``qkv`` and ``kv``) holds one independent adapter per targeted piece:
``lora_A`` ``(n_t r, in)`` (piece ``j``'s rows ``j r:(j + 1) r``), ``lora_B`` ``(n_t out_piece, r)``,
each piece's update going to its own output rows only (block-diagonal, :func:`vitp.parallel.layers.lora_up`).

Why vitp has its own layer rather than peft's: peft wraps ``nn.Linear`` (and Megatron-Core's
parallel linears through ``peft/tuners/lora/tp_layer.py``), not vitp's
:class:`~vitp.parallel.ColumnParallelLinear` / :class:`~vitp.parallel.RowParallelLinear`, whose
sequence-parallel gather, fused strided outputs, partial sync and deferred gradient sums the
adapter must follow. Here it follows its base linear:

- column-parallel: ``A`` whole, ``B``'s rows split like the weight's (per piece, the stride of a
  fused qkv / kv). ``h = A x`` reads the base's input inside the TP region (under sequence
  parallelism ``A`` rides in the base's all-gather, :func:`vitp.parallel.layers.gather_columns`),
  so the input gradient of the adapter joins the base's reduction. ``A``'s gradient is then a
  per-rank partial sum (each rank back-propagates through its rows of ``B``): it is summed over
  the TP group with the existing machinery (:func:`vitp.parallel.register_grad_allreduce`: once per
  step with deferred sync, ``r x in`` values), which is cheaper than all-reducing the ``(B, N, r)``
  activation gradient of every micro-batch and needs no second input reduction;
- row-parallel: ``A``'s columns split like the weight's, ``B`` whole; the partial ``B A_i x_i`` is
  added to the base's partial output before its all-reduce / reduce-scatter / partial sync, so no
  reduction is added. ``B``'s gradient is a partial sum (``h_i`` differs per rank), summed the same
  way (``out x r`` values per step);
- a plain ``nn.Linear`` (tp = 1) becomes :class:`LoraLinear` (same parameters and keys).

Under context or pipeline parallelism nothing more is needed: every parameter sees its rank's
tokens and the data-parallel reduction over ``dp x cp`` sums them, as for the base.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import (ColumnParallelLinear, RowParallelLinear, _mark_sharded, lora_input, lora_up,
                     register_grad_allreduce, shard_tensor)


def lora_scaling(rank: int, alpha: float, rslora: bool = False) -> float:
    """peft's ``LoraConfig`` scaling: ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``
    (arXiv:2312.03732). Raises ``ValueError`` for ``rank <= 0``."""
    if rank <= 0:
        raise ValueError(f"LoRA rank {rank}: must be a positive integer (trainer.lora.rank=16, for example)")
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


def init_lora(in_features: int, out_piece: int, n_targeted: int, rank: int, generator: torch.Generator,
              b_std: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full fp32 factors of one linear: ``A`` ``(n_targeted r, in_features)`` drawn as peft draws
    ``lora_A`` (``kaiming_uniform_(a=sqrt(5))``: uniform in ``+-1 / sqrt(in_features)``), ``B``
    ``(n_targeted out_piece, r)`` zero (``b_std > 0``: normal with that std, for tests where every
    path must matter from the first step)."""
    A = torch.empty(n_targeted * rank, in_features)
    for j in range(n_targeted):  # each piece as its own nn.Linear(in, r) weight
        nn.init.kaiming_uniform_(A[j * rank:(j + 1) * rank], a=math.sqrt(5), generator=generator)
    B = torch.zeros(n_targeted * out_piece, rank)
    if b_std > 0:
        B.normal_(0.0, b_std, generator=generator)
    return A, B


class LoraLinear(nn.Linear):
    """``nn.Linear`` with a LoRA adapter (module docstring): ``forward(x (..., in)) -> (..., out)``
    ``= W x + b + scaling * B A dropout(x)``. Made by :func:`attach_lora` from a plain
    ``nn.Linear`` (its class swapped: parameters and keys unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + lora_up(self, F.linear(lora_input(self, x, False), self.lora_A))


def attach_lora(linear: nn.Module, A: torch.Tensor, B: torch.Tensor, *, pieces: Sequence[int], num_pieces: int,
                rank: int, alpha: float, rslora: bool = False, dropout: float = 0.0, state=None) -> nn.Module:
    """Register a LoRA adapter on ``linear`` from its full factors ``A`` ``(n_t r, in)`` and ``B``
    ``(n_t out / num_pieces, r)`` (the tp = 1 tensors, identical on every rank), keeping this
    rank's share (module docstring) in the base weight's dtype; ``pieces``: the targeted pieces
    among ``num_pieces`` fused ones, ascending. ``state``: the :class:`~vitp.parallel.ParallelState`
    of a tensor-parallel linear. Returns ``linear``.

    Raises ``TypeError`` for another module than ``nn.Linear`` / :class:`~vitp.parallel.ColumnParallelLinear`
    / :class:`~vitp.parallel.RowParallelLinear`, ``ValueError`` for shapes that do not fit.
    """
    pieces = tuple(int(p) for p in pieces)
    n_t = len(pieces)
    out = linear.out_features
    if not pieces or list(pieces) != sorted(set(pieces)) or pieces[-1] >= num_pieces or out % num_pieces:
        raise ValueError(f"LoRA pieces {pieces} of {num_pieces} do not fit a linear of {out} outputs")
    if tuple(A.shape) != (n_t * rank, linear.in_features) or tuple(B.shape) != (n_t * out // num_pieces, rank):
        raise ValueError(f"LoRA factors {tuple(A.shape)}, {tuple(B.shape)} do not fit {type(linear).__name__}"
                         f"({linear.in_features} -> {out}) with {n_t} piece(s) of rank {rank}")
    tp, tp_rank = (state.tp_size, state.tp_rank) if state is not None else (1, 0)
    if isinstance(linear, ColumnParallelLinear):
        if linear.stride % num_pieces:
            raise ValueError(f"LoRA: {num_pieces} pieces on a column-parallel linear of stride {linear.stride}")
        stride = n_t * (linear.stride // num_pieces)  # B's rows: each piece split like its rows of the weight
        B = shard_tensor(B, 0, stride, tp, tp_rank)
    elif isinstance(linear, RowParallelLinear):
        if num_pieces != 1:
            raise ValueError("LoRA: a row-parallel linear has one piece")
        A = shard_tensor(A, 1, 1, tp, tp_rank)
    elif type(linear) is nn.Linear or isinstance(linear, LoraLinear):
        linear.__class__ = LoraLinear
    else:
        raise TypeError(f"LoRA on {type(linear).__name__}: only nn.Linear and vitp's column-/row-parallel "
                        "linears take an adapter")
    dtype = linear.weight.dtype
    linear.lora_A = nn.Parameter(A.detach().to(dtype).clone().contiguous())
    linear.lora_B = nn.Parameter(B.detach().to(dtype).clone().contiguous())
    linear.lora_pieces, linear.lora_num_pieces, linear.lora_rank = pieces, int(num_pieces), int(rank)
    linear.lora_alpha, linear.lora_scaling = float(alpha), lora_scaling(rank, alpha, rslora)
    linear.lora_dropout = nn.Dropout(dropout)
    if tp > 1 and isinstance(linear, ColumnParallelLinear):
        _mark_sharded(linear.lora_B, 0, stride)
        register_grad_allreduce(linear.lora_A, state, "tp_partial_grad")
    elif tp > 1 and isinstance(linear, RowParallelLinear):
        _mark_sharded(linear.lora_A, 1, 1)
        register_grad_allreduce(linear.lora_B, state, "tp_partial_grad")
    return linear


def lora_linears(module: nn.Module) -> Sequence[Tuple[str, nn.Module]]:
    """``[(name, linear)]`` of the linears in ``module`` that carry an adapter."""
    return [(n, m) for n, m in module.named_modules() if getattr(m, "lora_A", None) is not None]


def is_lora_key(name: str) -> bool:
    """Whether a parameter name is an adapter factor (``*.lora_A`` / ``*.lora_B``)."""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


__all__ = ["LoraLinear", "attach_lora", "init_lora", "is_lora_key", "lora_linears", "lora_scaling"]
