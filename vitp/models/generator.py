"""Class-conditional ViT generator: tubelet embedding, adaLN-Zero blocks around timm layers.

The model follows DiT (Peebles & Xie 2023, facebookresearch/DiT ``models.py``) with the plain
pixel-space x-prediction setting of JiT (Li & He 2025, arXiv 2511.13720). Every block holds a
timm ``Attention`` as ``attn`` and a timm ``Mlp``/``SwiGLU`` as ``mlp``; tensor parallelism
replaces exactly those two submodules (:mod:`vitp.models.parallelize`), so this file contains no
parallel code. Every layer is built from plain arguments, as timm's ``Block(dim, num_heads, ...)``.

Shapes: video/image ``x`` is ``(B, C, T, H, W)`` (an image is ``T=1``); tokens are
``(B, N, D)`` with ``N = (T/pt) * (H/p) * (W/p)`` ordered ``(t, h, w)`` row-major; the
conditioning ``c`` is ``(B, D)``.

Shapes may change between calls (non-square sizes, buckets of several resolutions and frame
counts): every layer that needs the token grid holds it and :func:`set_grid` changes it on all
layers of a model at once (positions are recomputed for the new grid). :class:`Generator` follows
its input by itself; a pipeline, whose later stages never see the input, is told the grid of each
step by the trainer.

Attention modes (``model.attention``):

- ``full``: every block attends jointly over all ``N`` tokens.
- ``factorized``: Latte's alternating variant (Ma et al. 2024, arXiv 2401.03048, variant 1):
  even blocks attend spatially over ``(B * gt, gh * gw, D)``, odd blocks temporally over
  ``(B * gh * gw, gt, D)``. The parameters are those of the full model (same shapes and
  state-dict keys), so weights are interchangeable. Only the attention call is regrouped
  (:class:`~vitp.models.layers.TokenGroups`); norms, adaLN and MLP are token-wise. With
  ``gt == 1`` a spatial block equals a full block and a temporal block attends over one token
  (its output is ``proj(v)`` of that token).
"""
from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
from timm.layers import DropPath, LayerScale, Mlp, SwiGLU

from vitp.config import mlp_hidden_units, validate_model
from vitp.utils import to_dict

from .layers import (
    CrossAttention,
    GridAttention,
    TimestepEmbedder,
    TokenGroups,
    TubeletEmbed,
    input_grid,
    masked_mean,
    modulate,
    sincos_3d_pos_embed,
    token_grid,
)

Grid = Tuple[int, int, int]


class Embed(nn.Module):
    """Input stage: ``(z_t, t, y)`` -> ``(tokens (B, N, D), c (B, D))``, or with captions
    ``(z_t, t, y, mask)`` -> ``(tokens, c, ctx (B, L, D), mask (B, L))``.

    ``z_t`` is ``(B, C, T, H, W)``, ``t`` is ``(B,)`` in [0, 1]. Class-conditional
    (``text_dim == 0``): ``y`` is ``(B,)`` int64 where ``y == num_classes`` is the null class used
    for classifier-free guidance. Text-conditional (``text_dim > 0``): ``y`` is the encoder's
    per-token caption embedding ``(B, L, text_dim)`` and ``mask`` ``(B, L)`` bool its valid
    tokens; as PixArt-alpha (Chen et al. 2023, arXiv 2310.00426), ``y_embedder`` (a timm ``Mlp``,
    GELU-tanh) projects it to the blocks' width as ``ctx`` for their cross-attention, and the
    masked mean of ``ctx`` through ``y_pool`` (``Linear(D, D)``) is added to the timestep
    embedding, so adaLN sees the caption too (the pooled text vector of SD3's adaLN). The null
    caption of classifier-free guidance is the encoded empty caption, an input like any other.
    ``grid`` is the token grid ``(gt, gh, gw)`` (:func:`~vitp.models.layers.token_grid`).

    Raises ``ValueError`` for a caption whose mask holds no valid token.
    """

    def __init__(self, in_channels: int, width: int, patch_size: int, tubelet_size: int, grid: Grid,
                 num_classes: int, text_dim: int = 0):
        super().__init__()
        self.p, self.pt, self.width, self.text_dim = patch_size, tubelet_size, width, int(text_dim)
        self.grid = tuple(int(g) for g in grid)
        self.x_embedder = TubeletEmbed(in_channels, width, patch_size, tubelet_size)
        self.t_embedder = TimestepEmbedder(width)
        if self.text_dim:
            self.y_embedder = Mlp(self.text_dim, width, width, act_layer=lambda: nn.GELU(approximate="tanh"))
            self.y_pool = nn.Linear(width, width)
            for lin in (self.y_embedder.fc1, self.y_embedder.fc2, self.y_pool):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
        else:
            self.y_embedder = nn.Embedding(num_classes + 1, width)
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        self.register_buffer("pos_embed", sincos_3d_pos_embed(*self.grid, width)[None], persistent=False)
        self._pos_cache: Dict[Grid, torch.Tensor] = {}

    def set_grid(self, grid: Grid) -> None:
        """Use the token grid ``(gt, gh, gw)`` from now on (sin-cos positions of that grid, cached per grid)."""
        grid = tuple(int(g) for g in grid)
        if grid == self.grid:
            return
        self._pos_cache[self.grid] = self.pos_embed
        pos = self._pos_cache.get(grid)
        if pos is None:
            pos = sincos_3d_pos_embed(*grid, self.width)[None]
        # like the buffer it replaces: .to(device) / a bf16 cast of the module moved or cast that one
        self.grid, self.pos_embed = grid, pos.to(self.pos_embed.device, self.pos_embed.dtype)

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        """Raises ``ValueError`` if ``z_t`` does not tile into tubelets or its grid is not the set
        grid (:func:`set_grid`: later layers would unpatchify with another grid), or if the
        conditioning does not fit ``text_dim``."""
        grid = input_grid(z_t.shape, self.p, self.pt)
        if grid != self.grid:
            raise ValueError(f"input token grid {grid} (of z_t {tuple(z_t.shape)}) differs from the model's grid "
                             f"{self.grid}; call vitp.models.set_grid(model, grid) on every layer first")
        z_t = z_t.to(self.x_embedder.proj.weight.dtype)  # data arrive in fp32; weights may be bf16
        tokens = self.x_embedder(z_t) + self.pos_embed.to(z_t.dtype)
        c = self.t_embedder(t).to(tokens.dtype)
        if not self.text_dim:
            if mask is not None or y.dim() != 1:
                raise ValueError(f"a class-conditional model takes labels y (B,), got {tuple(y.shape)}"
                                 f"{' and a caption mask' if mask is not None else ''}; train with model.text_dim > 0 "
                                 "for captions")
            return tokens, c + self.y_embedder(y)
        if mask is None or y.dim() != 3 or y.shape[-1] != self.text_dim:
            raise ValueError(f"a text-conditional model (model.text_dim={self.text_dim}) takes caption embeddings "
                             f"(B, L, {self.text_dim}) and their mask (B, L); got y {tuple(y.shape)}")
        if not bool(mask.any(dim=1).all()):  # an all-padding row would make attention NaN
            raise ValueError("a caption mask row has no valid token: every encoded caption has at least its end token")
        ctx = self.y_embedder(y.to(tokens.dtype))
        return tokens, c + self.y_pool(masked_mean(ctx, mask)), ctx, mask


class Block(nn.Module):
    """DiT adaLN-Zero block around timm's ``Attention`` (``self.attn``, a
    :class:`~vitp.models.layers.GridAttention`) and ``Mlp``/``SwiGLU`` (``self.mlp``).
    ``forward(x (B, N, D), c (B, D)) -> (B, N, D)``.

    ``attention``: ``"full"`` (all ``N`` tokens), ``"spatial"`` or ``"temporal"`` (regrouped
    with :class:`~vitp.models.layers.TokenGroups` over ``grid``); the parameters do not depend on
    it. The gates start at zero (adaLN-Zero), so each block is the identity at initialisation.

    ``cross_attn=True`` (text conditioning) adds PixArt-alpha's cross-attention sub-layer between
    attention and MLP: ``x = x + cross_attn(norm_cross(x), ctx, mask)``
    (:class:`~vitp.models.layers.CrossAttention`, output projection zero at init; ``norm_cross`` a
    LayerNorm without parameters), and ``forward`` takes ``(x, c, ctx (B, L, D), mask (B, L))``.

    Raises ``ValueError`` for an unknown ``attention`` or ``mlp``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, mlp: str = "gelu", qkv_bias: bool = True,
                 qk_norm: bool = False, layer_scale_init: Optional[float] = None, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, drop_path: float = 0.0, attention: str = "full",
                 grid: Optional[Grid] = None, cross_attn: bool = False):
        super().__init__()
        if attention == "full":
            self.token_groups = None
        elif attention in TokenGroups.KINDS:
            self.token_groups = TokenGroups(attention, grid)
        else:
            raise ValueError(f"block attention {attention!r}; use 'full', 'spatial' or 'temporal'")
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = GridAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop,
                                  proj_drop=proj_drop, norm_layer=nn.LayerNorm)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = mlp_hidden_units(dim, mlp_ratio, mlp)
        if mlp == "gelu":
            self.mlp = Mlp(dim, hidden, act_layer=lambda: nn.GELU(approximate="tanh"), drop=proj_drop)
        elif mlp == "swiglu":
            self.mlp = SwiGLU(dim, hidden, drop=proj_drop)
        else:
            raise ValueError(f"model.mlp={mlp!r} is not supported; use 'gelu' or 'swiglu'")
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init else nn.Identity()
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        if cross_attn:
            self.norm_cross = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.cross_attn = CrossAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop,
                                             proj_drop=proj_drop)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self._init_weights()

    def _init_weights(self) -> None:
        for m in (self.attn, self.mlp, getattr(self, "cross_attn", None)):
            if m is None:
                continue
            for lin in m.modules():
                if isinstance(lin, nn.Linear):
                    nn.init.xavier_uniform_(lin.weight)
                    if lin.bias is not None:
                        nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)
        if hasattr(self, "cross_attn"):  # PixArt: the cross-attention starts as a no-op
            nn.init.zeros_(self.cross_attn.proj.weight)
            nn.init.zeros_(self.cross_attn.proj.bias)

    def set_grid(self, grid: Grid) -> None:
        """Regroup factorized attention over the token grid ``grid`` from now on (no-op for full attention)."""
        if self.token_groups is not None and tuple(grid) != self.token_groups.grid:
            self.token_groups = TokenGroups(self.token_groups.kind, grid)

    def forward(self, x: torch.Tensor, c: torch.Tensor, ctx: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        h = modulate(self.norm1(x), shift1, scale1)
        h = self.ls1(self.attn(h) if self.token_groups is None else self.attn(h, token_groups=self.token_groups))
        x = x + self.drop_path1(gate1.unsqueeze(1) * h)
        if hasattr(self, "cross_attn"):
            if ctx is None or mask is None:
                raise ValueError("a text-conditional block needs the caption tokens ctx (B, L, D) and mask (B, L)")
            x = x + self.cross_attn(self.norm_cross(x), ctx, mask)
        h = self.ls2(self.mlp(modulate(self.norm2(x), shift2, scale2)))
        return x + self.drop_path2(gate2.unsqueeze(1) * h)


class FinalLayer(nn.Module):
    """adaLN + linear to pixels + unpatchify: ``(x (B, N, D), c (B, D)) -> (B, C, T, H, W)``."""

    def __init__(self, width: int, patch_size: int, tubelet_size: int, out_channels: int, grid: Grid):
        super().__init__()
        self.p, self.pt, self.C = patch_size, tubelet_size, out_channels
        self.grid = tuple(grid)
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, self.pt * self.p * self.p * self.C)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        for lin in (self.linear, self.adaLN_modulation[-1]):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def set_grid(self, grid: Grid) -> None:
        """Unpatchify to the token grid ``grid`` from now on."""
        self.grid = tuple(int(g) for g in grid)

    def forward(self, x: torch.Tensor, c: torch.Tensor, *text: torch.Tensor) -> torch.Tensor:
        """``text``: the caption tokens and mask of a text-conditional model, unused here."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        x = self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, pt*p*p*C)
        B = x.shape[0]
        gt, gh, gw = self.grid
        x = x.view(B, gt, gh, gw, self.pt, self.p, self.p, self.C)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, gt, pt, gh, p, gw, p)
        return x.reshape(B, self.C, gt * self.pt, gh * self.p, gw * self.p)


def layer_specs(in_channels: int, image_size: Any, num_frames: int, num_classes: int, patch_size: int,
                tubelet_size: int, width: int, depth: int, num_heads: int, mlp_ratio: float = 4.0,
                mlp: str = "gelu", qkv_bias: bool = True, qk_norm: bool = False,
                layer_scale_init: Optional[float] = None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                drop_path: float = 0.0, attention: str = "full", text_dim: int = 0,
                text_len: int = 0, family: str = "vit", preset: Optional[str] = None,
                expert: Optional[str] = None) -> List[Tuple[type, Dict[str, Any]]]:
    """The generator as an ordered list of ``(class, kwargs)``: Embed, depth x Block, FinalLayer
    (the fields of ``ModelConfig`` as arguments: ``layer_specs(**model_cfg)``). ``image_size`` is
    an int (square), ``(H, W)`` or ``"HxW"``; it sets the initial grid only (:func:`set_grid`).

    The pipeline (:mod:`vitp.pipeline`) and :class:`Generator` build from this same list with
    the same per-layer seed, so their weights are identical at any number of stages. Block
    ``i`` gets ``attention="full"``, or for ``attention="factorized"`` ``"spatial"`` (even
    ``i``) / ``"temporal"`` (odd ``i``); its drop-path rate grows linearly to ``drop_path``.
    ``text_dim > 0`` makes the generator text-conditional (caption embeddings of that many
    channels; every block gets cross-attention); ``text_len`` (caption tokens L) sizes nothing
    here (the planner's estimates use it). ``family``, ``preset`` and ``expert`` are read by nothing here: a
    Wan model (``model.family=wan``, :mod:`vitp.models.wan_run`) is built and planned from its own
    layers (:mod:`vitp.models.wan`, :mod:`vitp.plan.shapes`).
    """
    grid = token_grid(image_size, num_frames, patch_size, tubelet_size)
    rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]
    kinds = ["full"] * depth if attention == "full" else ["spatial" if i % 2 == 0 else "temporal" for i in range(depth)]
    block = dict(dim=width, num_heads=num_heads, mlp_ratio=mlp_ratio, mlp=mlp, qkv_bias=qkv_bias, qk_norm=qk_norm,
                 layer_scale_init=layer_scale_init, attn_drop=attn_drop, proj_drop=proj_drop, grid=grid,
                 cross_attn=text_dim > 0)
    embed = dict(in_channels=in_channels, width=width, patch_size=patch_size, tubelet_size=tubelet_size, grid=grid,
                 num_classes=num_classes, text_dim=text_dim)
    final = dict(width=width, patch_size=patch_size, tubelet_size=tubelet_size, out_channels=in_channels, grid=grid)
    blocks = [(Block, dict(block, drop_path=r, attention=k)) for r, k in zip(rates, kinds)]
    return [(Embed, embed)] + blocks + [(FinalLayer, final)]


def set_grid(model: nn.Module, grid: Grid) -> None:
    """Set the token grid ``(gt, gh, gw)`` of every layer of ``model`` (a :class:`Generator`, a
    pipeline module or one stage of it): positions, factorized attention groups, unpatchify, and
    whatever else holds the grid through a ``set_grid`` method of its own (under sequence
    parallelism, the true token count of tensor-parallel attention, which the padding of each
    step follows).

    Every rank of a step must set the same grid: stages after the first never see the input.
    """
    grid = tuple(int(g) for g in grid)
    for m in model.modules():
        if callable(getattr(m, "set_grid", None)):
            m.set_grid(grid)


def seed_layer(seed: int) -> None:
    """Seed used before building layer ``i`` with ``seed = base_seed + i`` (as DeepSpeed's
    ``PipelineModule(seed_layers=True)`` does)."""
    seed = int(seed)  # DeepSpeed passes numpy integers
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Generator(nn.Module):
    """Single-process generator: ``forward(z_t, t, y, mask=None) -> x_pred`` with shapes as in the
    module doc (``y, mask``: labels, or caption embeddings and mask, as :class:`Embed`).

    Built from the fields of ``ModelConfig`` as keyword arguments (see :func:`layer_specs`);
    :meth:`from_config` takes the config section itself. With ``seed``, layer ``i`` is built
    after seeding ``seed + i``, matching the pipeline's per-layer seeding.

    Raises ``ValueError`` when the sizes do not divide (:func:`vitp.config.validate_model`).
    """

    def __init__(self, seed: Optional[int] = None, **model: Any):
        super().__init__()
        validate_model(SimpleNamespace(**model))
        built = []
        for i, (cls, kw) in enumerate(layer_specs(**model)):
            if seed is not None:
                seed_layer(seed + i)
            built.append(cls(**kw))
        self.embed, self.final = built[0], built[-1]
        self.blocks = nn.ModuleList(built[1:-1])

    @classmethod
    def from_config(cls, model_cfg: Any, seed: Optional[int] = None) -> "Generator":
        """:class:`Generator` of a ``model`` config section (DictConfig, dataclass or mapping)."""
        return cls(seed=seed, **to_dict(model_cfg))

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        grid = input_grid(z_t.shape, self.embed.p, self.embed.pt)
        if grid != self.embed.grid:  # another size than the last call: follow the input
            set_grid(self, grid)
        x, c, *text = self.embed(z_t, t, y) if mask is None else self.embed(z_t, t, y, mask)
        for blk in self.blocks:
            x = blk(x, c, *text)
        return self.final(x, c)
