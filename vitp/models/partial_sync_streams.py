"""A partially synchronized generator (:mod:`vitp.parallel.partial_sync`) run on one device.

:class:`PartialSyncGenerator` runs the ``tp`` residual streams of a ``parallel.partial_sync < 1``
model one after the other in one process, from the full (timm-layout) weights of a
:class:`~vitp.models.Generator`; the collectives become plain sums over the streams. It is the
model that samples and evaluates a ``p < 1`` run on one device (the per-rank shards are fixed
slices of the full weights, so full weights + ``(tp, p, scale)`` define the function; see
:func:`vitp.checkpoint.export.generator_from_state`), and, being the straightforward
implementation of the rule, the reference the tests compare the distributed model against
(forward and gradients).

Per block, with rank ``r``'s heads / hidden units (:func:`vitp.parallel.shard_tensor` of the
full weights), ``o_r`` its partial ``proj`` / ``fc2`` output (no bias) and ``k = int(p * D)``:

    y_r = cat(sum_s o_s[..., :k], scale * o_r[..., k:]) + bias
    x_r = x_r + gate * ls(y_r)                    (attention, then MLP)

and the prediction is ``mean_r final(x_r, c)``. Dropout and drop-path are not modelled (use it
in eval mode, or with them at zero).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitp.parallel.layers import shard_tensor
from vitp.parallel.partial_sync import check_partial_sync, private_scale, synced_channels

from .generator import Block, Generator, input_grid, set_grid
from .layers import modulate


def _attention(attn: nn.Module, h: torch.Tensor, r: int, tp: int, groups) -> torch.Tensor:
    """Rank ``r``'s heads of timm ``Attention`` ``attn`` on ``h`` ``(B, N, D)`` -> partial
    ``proj`` output ``(B, N, D)`` without the bias (as :class:`vitp.parallel.TPAttention`)."""
    w = shard_tensor(attn.qkv.weight, 0, 3, tp, r)
    b = None if attn.qkv.bias is None else shard_tensor(attn.qkv.bias, 0, 3, tp, r)
    qkv = F.linear(h, w, b)
    if groups is not None:
        qkv = groups.group(qkv)
    bg, ng = qkv.shape[:2]
    heads = attn.num_heads // tp
    q, k, v = qkv.reshape(bg, ng, 3, heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    o = F.scaled_dot_product_attention(attn.q_norm(q), attn.k_norm(k), v, scale=attn.scale)
    o = o.transpose(1, 2).reshape(bg, ng, heads * attn.head_dim)
    if groups is not None:
        o = groups.ungroup(o)
    return F.linear(o, shard_tensor(attn.proj.weight, 1, 1, tp, r))


def _mlp(mlp: nn.Module, h: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    """Rank ``r``'s hidden units of a timm ``Mlp`` / ``SwiGLU`` -> partial ``fc2`` output, no bias."""
    def col(lin):
        b = None if lin.bias is None else shard_tensor(lin.bias, 0, 1, tp, r)
        return F.linear(h, shard_tensor(lin.weight, 0, 1, tp, r), b)

    a = mlp.act(col(mlp.fc1_g)) * col(mlp.fc1_x) if hasattr(mlp, "fc1_g") else mlp.act(col(mlp.fc1))
    return F.linear(a, shard_tensor(mlp.fc2.weight, 1, 1, tp, r))


def _cross(cross: nn.Module, h: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    """Rank ``r``'s heads of a :class:`~vitp.models.CrossAttention` -> partial ``proj`` output, no bias."""
    def col(lin, x, stride):
        b = None if lin.bias is None else shard_tensor(lin.bias, 0, stride, tp, r)
        return F.linear(x, shard_tensor(lin.weight, 0, stride, tp, r), b)

    o = cross.attend(col(cross.q, h, 1), col(cross.kv, ctx, 2), mask)
    return F.linear(o, shard_tensor(cross.proj.weight, 1, 1, tp, r))


def partial_sum(parts: List[torch.Tensor], k: int, scale: float, bias) -> List[torch.Tensor]:
    """Every rank's stream update from the ranks' partial outputs ``parts`` (each ``(B, N, D)``):
    channels ``[:k]`` summed over the ranks, ``[k:]`` rank-local times ``scale``, plus ``bias``."""
    total = torch.stack(parts).sum(0)[..., :k]
    out = [torch.cat([total, scale * o[..., k:]], dim=-1) for o in parts]
    return out if bias is None else [y + bias for y in out]


def block_streams(blk: Block, xs: List[torch.Tensor], c: torch.Tensor, p: float, scale: float,
                  *text: torch.Tensor) -> List[torch.Tensor]:
    """One generator :class:`~vitp.models.Block` over the ``tp = len(xs)`` streams ``xs``
    (``text``: the caption tokens and mask of a text-conditional block)."""
    tp = len(xs)
    shift1, scale1, gate1, shift2, scale2, gate2 = blk.adaLN_modulation(c).chunk(6, dim=-1)
    attn, mlp = blk.attn, blk.mlp
    parts = [_attention(attn, modulate(blk.norm1(x), shift1, scale1), r, tp, blk.token_groups)
             for r, x in enumerate(xs)]
    ys = partial_sum(parts, synced_channels(attn.proj.out_features, p), scale, attn.proj.bias)
    xs = [x + blk.drop_path1(gate1.unsqueeze(1) * blk.ls1(y)) for x, y in zip(xs, ys)]
    if hasattr(blk, "cross_attn"):
        cross = blk.cross_attn
        parts = [_cross(cross, blk.norm_cross(x), *text, r, tp) for r, x in enumerate(xs)]
        xs = [x + y for x, y in zip(xs, partial_sum(parts, synced_channels(cross.proj.out_features, p), scale,
                                                     cross.proj.bias))]
    parts = [_mlp(mlp, modulate(blk.norm2(x), shift2, scale2), r, tp) for r, x in enumerate(xs)]
    ys = partial_sum(parts, synced_channels(mlp.fc2.out_features, p), scale, mlp.fc2.bias)
    return [x + blk.drop_path2(gate2.unsqueeze(1) * blk.ls2(y)) for x, y in zip(xs, ys)]


class PartialSyncGenerator(nn.Module):
    """``forward(z_t, t, y, mask=None) -> x_pred`` of ``generator`` (full weights) run as ``tp`` partially
    synchronized streams on one process (module docstring). ``generator`` is kept as
    ``self.generator`` (its parameters are this module's; state-dict keys gain ``generator.``).

    Raises ``ValueError`` for ``tp < 1``, ``p`` outside [0, 1] or an unknown ``scale``, and when
    the heads or MLP hidden units do not divide ``tp``.
    """

    def __init__(self, generator: Generator, tp: int, p: float, scale: str = "sqrt_tp"):
        super().__init__()
        check_partial_sync(p, scale)
        if tp < 1:
            raise ValueError(f"tp={tp} must be >= 1")
        for blk in generator.blocks:
            hidden = blk.mlp.fc2.in_features
            if blk.attn.num_heads % tp or hidden % tp:
                raise ValueError(f"tp={tp} does not divide num_heads={blk.attn.num_heads} or MLP hidden={hidden}")
        self.generator, self.tp, self.p, self.scale_rule = generator, int(tp), float(p), scale
        self.scale = private_scale(self.tp, scale) if self.tp > 1 else 1.0

    @property
    def embed(self):  # the attributes samplers and evaluators read (grid, patch sizes)
        return self.generator.embed

    @property
    def final(self):
        return self.generator.final

    @property
    def blocks(self):
        return self.generator.blocks

    def extra_repr(self) -> str:
        return f"tp={self.tp}, partial_sync={self.p}, scale={self.scale_rule}"

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        gen = self.generator
        grid = input_grid(z_t.shape, gen.embed.p, gen.embed.pt)
        if grid != gen.embed.grid:
            set_grid(gen, grid)
        x, c, *text = gen.embed(z_t, t, y) if mask is None else gen.embed(z_t, t, y, mask)
        xs = [x] * self.tp
        for blk in gen.blocks:
            xs = block_streams(blk, xs, c, self.p, self.scale, *text)
        return torch.stack([gen.final(x, c) for x in xs]).mean(0)
