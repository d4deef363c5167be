"""Class-conditional ViT generator: tubelet embedding, adaLN-Zero blocks around timm layers.

The model follows DiT (Peebles & Xie 2023, facebookresearch/DiT ``models.py``) with the plain
pixel-space x-prediction setting of JiT (Li & He 2025, arXiv 2511.13720). Every block holds a
timm ``Attention`` as ``attn`` and a timm ``Mlp``/``SwiGLU`` as ``mlp``; tensor parallelism
replaces exactly those two submodules, so this file contains no parallel code.

Shapes: video/image ``x`` is ``(B, C, T, H, W)`` (an image is ``T=1``); tokens are
``(B, N, D)`` with ``N = (T/pt) * (H/p) * (W/p)`` ordered ``(t, h, w)`` row-major; the
conditioning ``c`` is ``(B, D)``.

Attention modes (``model.attention``):

- ``full``: every block attends jointly over all ``N`` tokens.
- ``factorized``: Latte's alternating variant (Ma et al. 2024, arXiv 2401.03048, variant 1):
  even blocks attend spatially over ``(B * gt, gh * gw, D)``, odd blocks temporally over
  ``(B * gh * gw, gt, D)``. The parameters are those of the full model (same shapes and
  state-dict keys), so weights are interchangeable. Only the attention call is regrouped
  (:class:`TokenGroups`); norms, adaLN and MLP are token-wise. With ``gt == 1`` a spatial
  block equals a full block and a temporal block attends over one token (its output is
  ``proj(v)`` of that token).

The regrouping is a property of the attention call, not of the block's tensors: the block
calls ``self.attn(x, token_groups=...)`` and the attention (:class:`GridAttention` here, or
:class:`vitp.parallel.TPAttention` after the tensor-parallel swap) regroups the full token
sequence around its head-wise core. Under sequence parallelism that is after the all-gather
and before the reduce-scatter (see :mod:`vitp.parallel.timm_tp`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass
from typing import Any, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import Attention, DropPath, LayerScale, Mlp, SwiGLU, build_sincos2d_pos_embed


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for mappings (dict, DictConfig), ``cfg.key`` for dataclasses; ``default`` if absent."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 1-D sin-cos embedding (Vaswani et al. 2017). ``positions`` (N,) -> (N, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(temperature) * torch.arange(half, dtype=torch.float64) / half)
    args = positions.double()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1).float()


def sincos_3d_pos_embed(grid_t: int, grid_h: int, grid_w: int, dim: int) -> torch.Tensor:
    """Separable space/time sin-cos position embedding, ``(grid_t * grid_h * grid_w, dim)``.

    Spatial part: timm's ``build_sincos2d_pos_embed`` over ``(grid_h, grid_w)``; temporal part: a
    1-D sin-cos over frame index; the two are added (as in Latte / Open-Sora). Token order is
    ``(t, h, w)`` row-major, matching :class:`TubeletEmbed`.
    """
    spatial = build_sincos2d_pos_embed([grid_h, grid_w], dim=dim)  # (H*W, D)
    temporal = sincos_1d(torch.arange(grid_t), dim)  # (T, D)
    return (temporal[:, None, :] + spatial[None, :, :]).reshape(grid_t * grid_h * grid_w, dim)


def token_grid(cfg: Any) -> Tuple[int, int, int]:
    """Token grid ``(gt, gh, gw) = (T / pt, H / p, W / p)``."""
    p, pt = config_value(cfg, "patch_size"), config_value(cfg, "tubelet_size")
    return (config_value(cfg, "num_frames") // pt, config_value(cfg, "image_size") // p,
            config_value(cfg, "image_size") // p)


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


class Embed(nn.Module):
    """Input stage: ``(z_t, t, y)`` -> ``(tokens (B, N, D), c (B, D))``.

    ``z_t`` is ``(B, C, T, H, W)``, ``t`` is ``(B,)`` in [0, 1], ``y`` is ``(B,)`` int64 where
    ``y == num_classes`` is the null class used for classifier-free guidance.
    """

    def __init__(self, cfg: Any):
        super().__init__()
        p, pt, D = config_value(cfg, "patch_size"), config_value(cfg, "tubelet_size"), config_value(cfg, "width")
        self.grid = token_grid(cfg)
        self.x_embedder = TubeletEmbed(config_value(cfg, "in_channels"), D, p, pt)
        self.t_embedder = TimestepEmbedder(D)
        self.y_embedder = nn.Embedding(config_value(cfg, "num_classes") + 1, D)
        nn.init.normal_(self.y_embedder.weight, std=0.02)
        self.register_buffer("pos_embed", sincos_3d_pos_embed(*self.grid, D)[None], persistent=False)

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z_t = z_t.to(self.x_embedder.proj.weight.dtype)  # data arrive in fp32; weights may be bf16
        tokens = self.x_embedder(z_t) + self.pos_embed.to(z_t.dtype)
        c = self.t_embedder(t).to(tokens.dtype) + self.y_embedder(y)
        return tokens, c


ATTENTION_MODES = ("full", "factorized")


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
        B, N, F = x.shape
        if N != self.num_tokens:
            raise ValueError(f"{self!r}: got {N} tokens, the grid holds {self.num_tokens}")
        gt, gh, gw = self.grid
        if self.kind == "spatial":
            return x.reshape(B * gt, gh * gw, F)
        return x.reshape(B, gt, gh * gw, F).transpose(1, 2).reshape(B * gh * gw, gt, F)

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
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


class Block(nn.Module):
    """DiT adaLN-Zero block around timm's ``Attention`` (``self.attn``, a :class:`GridAttention`)
    and ``Mlp``/``SwiGLU`` (``self.mlp``). ``forward(x (B, N, D), c (B, D)) -> (B, N, D)``.

    ``attention``: ``"full"`` (all ``N`` tokens), ``"spatial"`` or ``"temporal"`` (regrouped
    with :class:`TokenGroups` over the config's token grid); the parameters do not depend on it.
    The gates start at zero (adaLN-Zero), so each block is the identity at initialisation.
    """

    def __init__(self, cfg: Any, drop_path: float = 0.0, attention: str = "full"):
        super().__init__()
        D = config_value(cfg, "width")
        heads = config_value(cfg, "num_heads")
        hidden = int(D * config_value(cfg, "mlp_ratio"))
        if attention == "full":
            self.token_groups = None
        elif attention in TokenGroups.KINDS:
            self.token_groups = TokenGroups(attention, token_grid(cfg))
        else:
            raise ValueError(f"block attention {attention!r}; use 'full', 'spatial' or 'temporal'")
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = GridAttention(
            D,
            num_heads=heads,
            qkv_bias=config_value(cfg, "qkv_bias"),
            qk_norm=config_value(cfg, "qk_norm"),
            attn_drop=config_value(cfg, "attn_drop", 0.0),
            proj_drop=config_value(cfg, "proj_drop", 0.0),
            norm_layer=nn.LayerNorm,
        )
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        mlp = config_value(cfg, "mlp")
        if mlp == "gelu":
            self.mlp = Mlp(D, hidden, act_layer=lambda: nn.GELU(approximate="tanh"), drop=config_value(cfg, "proj_drop", 0.0))
        elif mlp == "swiglu":
            # 2/3 keeps the parameter count of the GELU MLP (Shazeer 2020).
            self.mlp = SwiGLU(D, int(hidden * 2 / 3), drop=config_value(cfg, "proj_drop", 0.0))
        else:
            raise ValueError(f"model.mlp={mlp!r} is not supported; use 'gelu' or 'swiglu'")
        init = config_value(cfg, "layer_scale_init")
        self.ls1 = LayerScale(D, init) if init else nn.Identity()
        self.ls2 = LayerScale(D, init) if init else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))
        self._init_weights()

    def _init_weights(self) -> None:
        for m in (self.attn, self.mlp):
            for lin in m.modules():
                if isinstance(lin, nn.Linear):
                    nn.init.xavier_uniform_(lin.weight)
                    if lin.bias is not None:
                        nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        h = modulate(self.norm1(x), shift1, scale1)
        h = self.ls1(self.attn(h) if self.token_groups is None else self.attn(h, token_groups=self.token_groups))
        x = x + self.drop_path1(gate1.unsqueeze(1) * h)
        h = self.ls2(self.mlp(modulate(self.norm2(x), shift2, scale2)))
        return x + self.drop_path2(gate2.unsqueeze(1) * h)


class FinalLayer(nn.Module):
    """adaLN + linear to pixels + unpatchify: ``(x (B, N, D), c (B, D)) -> (B, C, T, H, W)``."""

    def __init__(self, cfg: Any):
        super().__init__()
        D = config_value(cfg, "width")
        self.p, self.pt, self.C = config_value(cfg, "patch_size"), config_value(cfg, "tubelet_size"), config_value(cfg, "in_channels")
        self.grid = token_grid(cfg)
        self.norm_final = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(D, self.pt * self.p * self.p * self.C)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))
        for lin in (self.linear, self.adaLN_modulation[-1]):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        x = self.linear(modulate(self.norm_final(x), shift, scale))  # (B, N, pt*p*p*C)
        B = x.shape[0]
        gt, gh, gw = self.grid
        x = x.view(B, gt, gh, gw, self.pt, self.p, self.p, self.C)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, gt, pt, gh, p, gw, p)
        return x.reshape(B, self.C, gt * self.pt, gh * self.p, gw * self.p)


def num_tokens(cfg: Any) -> int:
    """Tokens per sample ``N = (T / pt) * (H / p) * (W / p)``."""
    return math.prod(token_grid(cfg))


def validate_model_config(cfg: Any) -> None:
    """Check divisibility constraints; raises ``ValueError`` naming the key and the valid values."""
    D, heads = config_value(cfg, "width"), config_value(cfg, "num_heads")
    size, p = config_value(cfg, "image_size"), config_value(cfg, "patch_size")
    T, pt = config_value(cfg, "num_frames"), config_value(cfg, "tubelet_size")
    if D % heads:
        valid = [h for h in range(1, D + 1) if D % h == 0 and D // h >= 8]
        raise ValueError(f"model.width={D} is not divisible by model.num_heads={heads}; valid num_heads: {valid}")
    if size % p:
        valid = [q for q in range(1, size + 1) if size % q == 0]
        raise ValueError(
            f"resolution {size} (data.resolution) is not divisible by model.patch_size={p}; "
            f"valid patch sizes: {valid}"
        )
    if T % pt:
        raise ValueError(f"num_frames {T} is not divisible by model.tubelet_size={pt}")
    if config_value(cfg, "depth") < 1:
        raise ValueError("model.depth must be >= 1")
    attention = config_value(cfg, "attention", "full")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"model.attention={attention!r} is not supported; use one of {list(ATTENTION_MODES)}")
    if attention == "factorized" and T // pt < 1:
        # gt == 1 is allowed: temporal blocks then attend over a single token (value/proj path).
        raise ValueError(f"model.attention=factorized needs num_frames / model.tubelet_size >= 1, "
                         f"got {T} / {pt}")


def layer_kinds(cfg: Any) -> list:
    """The generator as an ordered list of ``(class, kwargs)``: Embed, depth x Block, FinalLayer.

    The pipeline (:mod:`vitp.pipeline`) and :class:`Generator` build from this same list with
    the same per-layer seed, so their weights are identical at any number of stages. Block
    ``i`` gets ``attention="full"``, or for ``model.attention=factorized`` ``"spatial"`` (even
    ``i``) / ``"temporal"`` (odd ``i``).
    """
    depth, dp = config_value(cfg, "depth"), config_value(cfg, "drop_path", 0.0)
    rates = [dp * i / max(depth - 1, 1) for i in range(depth)]
    mode = config_value(cfg, "attention", "full")
    kinds = ["full"] * depth if mode == "full" else ["spatial" if i % 2 == 0 else "temporal" for i in range(depth)]
    blocks = [(Block, {"cfg": cfg, "drop_path": r, "attention": k}) for r, k in zip(rates, kinds)]
    return [(Embed, {"cfg": cfg})] + blocks + [(FinalLayer, {"cfg": cfg})]


def seed_layer(seed: int) -> None:
    """Seed used before building layer ``i`` with ``seed = base_seed + i`` (as DeepSpeed's
    ``PipelineModule(seed_layers=True)`` does)."""
    import random

    import numpy as np

    seed = int(seed)  # DeepSpeed passes numpy integers
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Generator(nn.Module):
    """Single-process generator: ``forward(z_t, t, y) -> x_pred`` with shapes as in the module doc.

    Parameters
    ----------
    cfg : ModelConfig (dataclass, DictConfig or dict)
    seed : int, optional
        If given, layer ``i`` of :func:`layer_kinds` is built after seeding ``seed + i``,
        matching the pipeline's per-layer seeding.
    """

    def __init__(self, cfg: Any, seed: int | None = None):
        super().__init__()
        validate_model_config(cfg)
        self.cfg = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
        built = []
        for i, (cls, kw) in enumerate(layer_kinds(cfg)):
            if seed is not None:
                seed_layer(seed + i)
            built.append(cls(**kw))
        self.embed, self.final = built[0], built[-1]
        self.blocks = nn.ModuleList(built[1:-1])

    def forward(self, z_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, c = self.embed(z_t, t, y)
        for blk in self.blocks:
            x = blk(x, c)
        return self.final(x, c)

    @staticmethod
    def layer_prefix(i: int, depth: int) -> str:
        """State-dict prefix of flat layer ``i`` (pipeline layer index) in this module."""
        if i == 0:
            return "embed."
        if i == depth + 1:
            return "final."
        return f"blocks.{i - 1}."
