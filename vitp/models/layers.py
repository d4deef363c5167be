"""Building blocks of the ViT generator: sin-cos positions, tubelet and timestep embedders,
token regrouping for factorized space/time attention, and adaLN modulation.

Shapes: video/image ``x`` is ``(B, C, T, H, W)`` (an image is ``T=1``); tokens are ``(B, N, D)``
with ``N = (T/pt) * (H/p) * (W/p)`` ordered ``(t, h, w)`` row-major.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, Mlp, build_sincos2d_pos_embed

from .grid import input_grid, num_tokens, token_grid  # noqa: F401 (their home before grid.py)


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 1-D sin-cos embedding (Vaswani et al. 2017). ``positions`` (N,) -> (N, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(temperature) * torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    args = positions.double()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1).float()


def sincos_3d_pos_embed(grid_t: int, grid_h: int, grid_w: int, dim: int) -> torch.Tensor:
    """Separable space/time sin-cos position embedding, ``(grid_t * grid_h * grid_w, dim)``.

    Spatial part: timm's ``build_sincos2d_pos_embed`` over ``(grid_h, grid_w)`` (``ij`` indexing:
    row ``h * grid_w + w`` holds position ``(h, w)``, so non-square grids are laid out like the
    tokens); temporal part: a 1-D sin-cos over frame index; the two are added (as in Latte /
    Open-Sora). Token order is ``(t, h, w)`` row-major, matching :class:`TubeletEmbed`. Like DiT
    and JiT, the table depends only on the grid, so a model trained at one resolution runs at
    another with the table of the new grid (no interpolation of learned positions).
    """
    spatial = build_sincos2d_pos_embed([grid_h, grid_w], dim=dim)  # (H*W, D)
    temporal = sincos_1d(torch.arange(grid_t), dim)  # (T, D)
    return (temporal[:, None, :] + spatial[None, :, :]).reshape(grid_t * grid_h * grid_w, dim)


class TubeletEmbed(nn.Module):
    """Non-overlapping ``(pt, p, p)`` tubelets -> tokens via a Conv3d (ViViT, Arnab et al. 2021).

    ``(B, C, T, H, W)`` -> ``(B, N, D)``.
    """

    def __init__(self, in_channels: int, width: int, patch_size: int, tubelet_size: int):
        super().__init__()
        k = (tubelet_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, width, kernel_size=k, stride=k)
        w = self.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # (B, N, D); p2p sends need contiguous


class TimestepEmbedder(nn.Module):
    """Scalar ``t`` in [0, 1] -> ``(B, D)``: 256-dim sinusoid of ``1000 t`` then a SiLU MLP (DiT)."""

    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = Mlp(freq_dim, width, width, act_layer=nn.SiLU)
        for lin in (self.mlp.fc1, self.mlp.fc2):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sincos_1d(t.float() * 1000.0, self.freq_dim).to(device=t.device, dtype=self.mlp.fc1.weight.dtype))


class TokenGroups:
    """Regrouping of a ``(t, h, w)``-ordered token sequence into independent attention groups.

    ``kind="spatial"``: ``(B, gt*gh*gw, F)`` -> ``(B*gt, gh*gw, F)`` (one group per frame, a view).
    ``kind="temporal"``: ``(B, gt*gh*gw, F)`` -> ``(B*gh*gw, gt, F)`` (one group per position).
    ``ungroup`` is the exact inverse. Any feature width ``F`` works, so a tensor-parallel
    attention can regroup its local ``qkv`` and output columns.
    """

    KINDS = ("spatial", "temporal")

    def __init__(self, kind: str, grid: Tuple[int, int, int]):
        if kind not in self.KINDS:
            raise ValueError(f"token group kind {kind!r}; use one of {self.KINDS}")
        self.kind, self.grid = kind, tuple(int(g) for g in grid)
        self.num_tokens = math.prod(self.grid)

    def __repr__(self) -> str:
        return f"TokenGroups({self.kind!r}, grid={self.grid})"

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, F)`` -> groups ``(B', N', F)``; raises ``ValueError`` if ``N`` is not the grid's token count."""
        B, N, F = x.shape
        if N != self.num_tokens:
            raise ValueError(f"{self!r}: got {N} tokens, the grid holds {self.num_tokens}")
        gt, gh, gw = self.grid
        if self.kind == "spatial":
            return x.reshape(B * gt, gh * gw, F)
        return x.reshape(B, gt, gh * gw, F).transpose(1, 2).reshape(B * gh * gw, gt, F)

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`group`: ``(B', N', F)`` -> ``(B, N, F)``."""
        gt, gh, gw = self.grid
        F = x.shape[-1]
        if self.kind == "spatial":
            return x.reshape(-1, self.num_tokens, F)
        return x.reshape(-1, gh * gw, gt, F).transpose(1, 2).reshape(-1, self.num_tokens, F)


class GridAttention(Attention):
    """timm ``Attention`` (same parameters, init and state-dict keys; the tensor-parallel swap
    replaces it like any timm ``Attention``) whose forward optionally regroups tokens:
    ``forward(x (B, N, D), token_groups=None) -> (B, N, D)``; with ``token_groups`` timm's
    forward sees a plain ``(B', N', D)`` batch of groups.
    """

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                token_groups: Optional[TokenGroups] = None) -> torch.Tensor:
        if token_groups is None:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("attention masks are not supported with token_groups")
        return token_groups.ungroup(super().forward(token_groups.group(x)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation: ``x (B, N, D) * (1 + scale (B, D)) + shift (B, D)``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class CrossAttention(nn.Module):
    """Multi-head cross-attention from image/video tokens to caption tokens, as PixArt-alpha's
    ``MultiHeadCrossAttention`` (Chen et al. 2023, arXiv 2310.00426; PixArt-alpha/PixArt-alpha
    ``diffusion/model/nets/PixArt_blocks.py``), laid out like timm's ``Attention``: ``q``
    ``Linear(D, D)``, ``kv`` ``Linear(D, 2 D)`` packed ``[K all heads | V all heads]``, per-head
    ``q_norm`` / ``k_norm`` (timm ``qk_norm``), ``proj`` ``Linear(D, D)``, timm's ``attn_drop`` /
    ``proj_drop``.

    ``forward(x (B, N, D), ctx (B, L, D), mask (B, L) bool) -> (B, N, D)``: queries from the ``N``
    tokens, keys/values from the ``L`` caption tokens, caption padding (``mask`` False) never
    attended. Every row of ``mask`` must hold a True (an encoded caption has at least its end
    token; :class:`vitp.models.Embed` checks). ``proj`` starts at zero (PixArt), so a block is the
    identity at initialisation as with adaLN-Zero.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"cross-attention width {dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj_drop(self.proj(self.attend(self.q(x), self.kv(ctx), mask)))

    def attend(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``q (B, N, h hd)`` over ``kv (B, L, 2 h hd)`` (``[K | V]``) with the
        key-padding ``mask (B, L)``, for any head count ``h`` (all heads, or one tensor-parallel
        rank's share): ``(B, N, h hd)``, before the output projection."""
        B, N, hd = q.shape[0], q.shape[1], self.head_dim
        h = q.shape[-1] // hd
        q = self.q_norm(q.view(B, N, h, hd).transpose(1, 2))
        k, v = kv.view(B, kv.shape[1], 2, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
        k = self.k_norm(k)
        p = self.attn_drop.p if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].to(torch.bool), dropout_p=p,
                                           scale=self.scale)
        return o.transpose(1, 2).reshape(B, N, h * hd)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x (B, L, D)`` over the tokens where ``mask (B, L)`` is True: ``(B, D)``."""
    w = mask.to(x.dtype).unsqueeze(-1)
    return (x * w).sum(1) / w.sum(1).clamp_min(1)
