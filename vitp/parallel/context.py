"""Context parallelism: every layer holds ``N / cp`` of each sample's tokens; attention meets
the rest of the sequence through the cp group.

Rank ``r`` of a context-parallel group holds tokens ``[r N / cp, (r + 1) N / cp)`` of the
``(t, h, w)``-ordered sequence from the embedding to the output head
(:func:`vitp.parallel.mappings.split_to_context_region` after the embedding,
:func:`~vitp.parallel.mappings.gather_from_context_region` of the head's output before the loss).
Token-wise layers (norms, adaLN modulation, MLP, the qkv and output projections) need nothing;
:class:`ContextAttention` is what a tensor-parallel attention (:class:`vitp.parallel.TPAttention`,
also at tp = 1) does around its attention core, on the ``qkv`` columns of its ``h = H / tp``
heads:

==========================  ===============================================  =====================
attention                   what moves (per block and micro-batch, forward)  needs
==========================  ===============================================  =====================
full, ``ulysses``           all-to-all of qkv ``(B, N/cp, 3 h hd)`` ->        ``h`` divisible by cp
                            ``(B, N, 3 h/cp hd)`` (heads scattered, tokens
                            gathered), all-to-all of the output back
                            (DeepSpeed-Ulysses, Jacobs et al. 2023,
                            arXiv 2309.14509)
full, ``ring``              K/V blocks ``(B, h, N/cp, hd)`` passed around    any head count
                            the ring, partial outputs merged by
                            log-sum-exp (Liu et al. 2023, arXiv
                            2310.01889; :func:`vitp.parallel.ring.ring_attention`)
factorized, spatial         nothing: a rank holds ``gt / cp`` whole frames   ``gt``, ``gh gw``
                                                                             divisible by cp
factorized, temporal        all-to-all of qkv ``(B, gt/cp, gh gw, 3 h hd)``  (same)
                            -> ``(B, gt, gh gw / cp, 3 h hd)`` (positions
                            scattered, frames gathered), all-to-all back
==========================  ===============================================  =====================

Bytes one rank sends per block and micro-batch, forward, with ``e`` bytes per element and
``T = B (N / cp) h hd e`` (one rank's share of one of q, k, v or the output): Ulysses and the
temporal exchange ``(3 T + T) (cp - 1) / cp``; ring ``2 T (cp - 1)``; spatial 0. Backward moves
the same again for the all-to-alls (their transposes); the ring passes K and V again
(``2 T (cp - 1)``) and their gradient accumulators in fp32, ``2 T' cp`` with ``T'`` = ``T`` at 4
bytes per element (:func:`vitp.parallel.ring.ring_traffic`). Frames are the shard axis of factorized attention
because half of its blocks then need no communication; positions are the exchanged axis of the
temporal blocks so that they split any head count.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from .mappings import all_to_all

MODES = ("ulysses", "ring")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class ContextAttention:
    """What an attention over ``heads`` local heads of ``head_dim`` does with the other token
    shards of its context-parallel ``group`` (``size`` ranks, ``mode`` ``"ulysses"`` or
    ``"ring"``; module docstring). ``grid`` is the full token grid ``(gt, gh, gw)``
    (:meth:`set_grid`).

    ``token_groups`` (factorized attention) is the model's regrouping object (``kind``,
    ``group``/``ungroup``, built as ``cls(kind, grid)``: :class:`vitp.models.TokenGroups`); its
    class regroups the local tokens on the local grid.

    :meth:`enter` takes this rank's ``qkv`` ``(B, N / cp, 3 heads head_dim)`` and returns the
    ``qkv`` to attend over, regrouped into independent sequences ``(B', N', 3 h' head_dim)``, and
    the function that brings the attention output ``(B', N', h' head_dim)`` back to
    ``(B, N / cp, heads head_dim)``; :attr:`ring` tells whether the core itself must be
    :func:`vitp.parallel.ring.ring_attention` (full attention in ring mode).

    Raises ``ValueError`` for an unknown mode, or (in :meth:`enter`) shapes that do not split.
    """

    def __init__(self, group, size: int, mode: str, grid: Optional[Sequence[int]] = None):
        if mode not in MODES:
            raise ValueError(f"parallel.cp_mode={mode!r}; use one of {MODES}")
        self.group, self.size, self.mode = group, int(size), mode
        self.grid = tuple(int(g) for g in grid) if grid is not None else None

    def __repr__(self) -> str:
        return f"ContextAttention(cp={self.size}, mode={self.mode!r}, grid={self.grid})"

    def set_grid(self, grid: Sequence[int]) -> None:
        """The full token grid ``(gt, gh, gw)`` of the next steps."""
        self.grid = tuple(int(g) for g in grid)

    def local_tokens(self) -> int:
        """``N / cp``: the tokens of this rank's shard."""
        return math.prod(self.grid) // self.size

    def ring(self, token_groups) -> bool:
        """True when the attention core is the ring (full attention in ``ring`` mode)."""
        return token_groups is None and self.mode == "ring"

    def enter(self, qkv: torch.Tensor, token_groups, head_dim: int) -> Tuple[torch.Tensor, Callable]:
        """``(B, N / cp, 3 h head_dim)`` -> ``(qkv to attend over, back)`` (class docstring)."""
        B, n, C = qkv.shape
        if self.grid is None or n != self.local_tokens():
            raise ValueError(f"context parallel: {n} local tokens for grid {self.grid} at cp={self.size}")
        if token_groups is None:
            if self.mode == "ring":
                return qkv, _identity
            return self._ulysses(qkv, head_dim)
        gt, gh, gw = self.grid
        if token_groups.kind == "spatial":  # whole frames are local: no communication
            local = type(token_groups)("spatial", (gt // self.size, gh, gw))  # the model's regrouping
            return local.group(qkv), local.ungroup
        return self._temporal(qkv, token_groups)

    def _ulysses(self, qkv: torch.Tensor, head_dim: int) -> Tuple[torch.Tensor, Callable]:
        B, n, C = qkv.shape
        h = C // (3 * head_dim)
        if h % self.size:
            raise ValueError(f"cp_mode=ulysses: {h} local heads do not split over cp={self.size}; use cp_mode=ring")
        full = all_to_all(qkv.reshape(B, n, 3, h, head_dim), 3, 1, self.group)  # (B, N, 3, h/cp, hd)
        N = full.shape[1]

        def back(o: torch.Tensor) -> torch.Tensor:  # (B, N, h/cp hd) -> (B, N/cp, h hd)
            o = all_to_all(o.reshape(B, N, h // self.size, head_dim), 1, 2, self.group)
            return o.reshape(B, n, h * head_dim)

        return full.reshape(B, N, 3 * (h // self.size) * head_dim), back

    def _temporal(self, qkv: torch.Tensor, token_groups) -> Tuple[torch.Tensor, Callable]:
        gt, gh, gw = self.grid
        B, n, C = qkv.shape
        hw = gh * gw
        # frames gathered, positions scattered: (B, gt/cp, hw, C) -> (B, gt, hw/cp, C)
        x = all_to_all(qkv.reshape(B, gt // self.size, hw, C), 2, 1, self.group)
        local = type(token_groups)("temporal", (gt, hw // self.size, 1))  # positions in one row

        def back(o: torch.Tensor) -> torch.Tensor:
            o = local.ungroup(o)  # (B, gt * hw/cp, F)
            F = o.shape[-1]
            o = all_to_all(o.reshape(B, gt, hw // self.size, F), 1, 2, self.group)
            return o.reshape(B, n, F)

        return local.group(x.reshape(B, gt * (hw // self.size), C)), back

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Ring attention of this rank's ``(B, h, N / cp, hd)`` queries over every rank's keys."""
        from .ring import ring_attention

        return ring_attention(q, k, v, self.group, scale)
