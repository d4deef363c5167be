"""Wan 2.1 / 2.2 text-to-video transformer as vitp layers (timm ``Attention`` and ``Mlp`` where they fit).

The model is Wan's DiT (Wan Team 2025, arXiv 2503.20314) as diffusers implements it in
``diffusers/models/transformers/transformer_wan.py`` (``WanTransformer3DModel``), which is the
reference this file matches output for output. It is split like :class:`vitp.models.Generator`
into an input stage, blocks and a final layer, with the submodules that tensor parallelism
later replaces under the generator's names: ``blocks.<i>.attn`` (a timm ``Attention`` with one
fused ``qkv``), ``blocks.<i>.cross_attn`` (``q``, fused ``kv``, ``proj``, an ``attend`` method,
as :class:`vitp.models.CrossAttention`) and ``blocks.<i>.mlp`` (a timm ``Mlp``).

Differences from vitp's generator, all Wan's:

- conditioning is adaLN-single (PixArt-alpha, Chen et al. 2023, arXiv 2310.00426): one shared
  ``time_proj`` (``SiLU``, ``Linear(D, 6 D)``) gives the modulation ``(B, 6, D)`` of every
  block, and each block adds its own learned ``scale_shift_table`` ``(1, 6, D)``;
- self-attention normalises q and k with an RMSNorm over all heads together (the whole inner
  width ``D``) and rotates them with 3-D rotary positions (t, h, w parts of each head);
- cross-attention to the projected text tokens has no gate and no modulation; its input is an
  affine LayerNorm (``cross_attn_norm``) and its q/k are RMSNorm'd across heads too;
- the timestep is in [0, 1000] (diffusers' scale), not [0, 1].

Shapes: latents ``(B, C, T, H, W)``; tokens ``(B, N, D)`` with ``N = (T/pt) (H/p) (W/p)``
ordered ``(t, h, w)`` row-major (``D = num_attention_heads * attention_head_dim``); text
``(B, L, text_dim)``. Precision follows diffusers: norms and the modulation in fp32, rotary
tables computed in float64 and applied in float32.

Wan 2.2 TI2V-5B's per-token timesteps (``expand_timesteps``: ``timestep (B, N)``, one per token,
as ``WanPipeline`` passes them) are taken as diffusers takes them: the modulation becomes
``(B, N, 6, D)`` and the output head's ``temb`` ``(B, N, D)``. A timestep equal over a sample's
tokens (text-to-video: the pipeline's ``(B, N)`` without an image is ``t`` everywhere) is the
same computation as the scalar ``(B,)``, so it is taken as ``(B,)`` (6 N times less modulation
to hold and pass between stages; equal to diffusers' per-token path, tests/unit/test_wan_model.py).
Image-to-video (``image_dim``, ``added_kv_proj_dim``) is not implemented: :class:`WanConfig`
refuses it. The weights of a diffusers folder are read by :mod:`vitp.models.wan_keys`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, Mlp

from .layers import CrossAttention, TubeletEmbed, input_grid
from .wan_config import INT_KEYS, OPTIONAL_INT_KEYS, QK_NORM, WanConfig, check_types  # noqa: F401 - re-exported

Grid = Tuple[int, int, int]
FP32_KEEP = ("t_embedder", "scale_shift_table", "norm1", "norm2", "norm3")  # diffusers' _keep_in_fp32_modules


def check_latents(x: torch.Tensor, in_channels: int, name: str = "hidden_states") -> None:
    """Raises ``ValueError`` naming the shape when ``x`` is not latents ``(B, in_channels, T, H, W)``
    (a 4-D image batch, or the channels of another VAE)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[1] != in_channels:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} {shape} must be latents (B, {in_channels}, T, H, W): {in_channels} channels "
                         "(the model's in_channels, the VAE's z_dim) and a frame axis (an image is T=1: "
                         "x.unsqueeze(2))")


FLOAT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float": torch.float32}


def float_dtype(dtype: Any) -> torch.dtype:
    """A floating ``torch.dtype`` of a dtype or its name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``,
    ...). Raises ``ValueError`` naming the value for a non-floating dtype or an unknown name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in FLOAT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not a floating dtype name; use one of {sorted(FLOAT_DTYPES)} "
                             "or torch.bfloat16 / torch.float16 / torch.float32")
        return FLOAT_DTYPES[name]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating dtype; Wan's weights are torch.float32, "
                         "torch.bfloat16 or torch.float16")
    return dtype


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and returned in the input's dtype (diffusers' ``FP32LayerNorm``):
    ``(..., D) -> (..., D)``. Wan keeps its norms in fp32 under bf16 weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of timesteps ``t (B,)`` in [0, 1000]: ``(B, dim)`` fp32, ``[cos | sin]``.

    As diffusers' ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)``
    (``get_timestep_embedding``, computed in fp32 the same way), which Wan's
    ``WanTimeTextImageEmbedding`` uses; an odd ``dim`` gets a zero last column.
    """
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class WanTimestepEmbedder(nn.Module):
    """Timesteps ``t (B,)`` (or per token ``(B, N)``) in [0, 1000] -> ``temb (B, D)`` (``(B, N, D)``):
    :func:`timestep_sinusoid` of the flattened timesteps then a timm ``Mlp`` (``fc1``, SiLU, ``fc2``),
    diffusers' ``TimestepEmbedding`` (``linear_1``, ``linear_2``) after ``Timesteps``, in its order."""

    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = Mlp(freq_dim, width, width, act_layer=nn.SiLU)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = timestep_sinusoid(t.flatten(), self.freq_dim).unflatten(0, t.shape)
        return self.mlp(emb.to(self.mlp.fc1.weight.dtype))


def rope_dims(head_dim: int) -> Tuple[int, int, int]:
    """Channels of a head rotated by the frame, row and column position: ``(t, h, w)`` with
    ``h = w = 2 (head_dim // 6)`` and ``t`` the rest (diffusers' ``WanRotaryPosEmbed``; 44, 42, 42
    for Wan's 128)."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rotary_freqs(grid: Grid, head_dim: int, max_seq_len: int = 1024, theta: float = 10000.0,
                 device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3-D rotary tables of the token grid ``(gt, gh, gw)``: ``(cos, sin)``, each
    ``(N, head_dim / 2)`` fp32, row ``n`` the token ``n`` of the ``(t, h, w)`` order, column ``j``
    the angle of channel pair ``(2j, 2j + 1)``.

    Per :func:`rope_dims` part of size ``d``: angles ``pos / theta ** (2i / d)`` in float64, then
    cos/sin cast to fp32, as diffusers' ``get_1d_rotary_pos_embed`` (Wan's table is
    ``max_seq_len`` rows; a grid takes its first rows). Raises ``ValueError`` when a grid side
    exceeds ``max_seq_len`` (``rope_max_seq_len`` of the config).
    """
    if max(grid) > max_seq_len:
        raise ValueError(f"token grid {tuple(grid)} exceeds rope_max_seq_len={max_seq_len} positions on a side; "
                         "use fewer latent frames or a smaller resolution")
    cos, sin = [], []
    for axis, (n, d) in enumerate(zip(grid, rope_dims(head_dim))):
        freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(n), freqs)  # (n, d/2) float64
        shape = [1, 1, 1, d // 2]
        shape[axis] = n
        cos.append(angles.cos().float().view(shape).expand(*grid, d // 2))
        sin.append(angles.sin().float().view(shape).expand(*grid, d // 2))
    n_tok = math.prod(grid)
    return (torch.cat(cos, -1).reshape(n_tok, head_dim // 2).to(device),
            torch.cat(sin, -1).reshape(n_tok, head_dim // 2).to(device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2j, 2j + 1)`` of ``x (B, H, N, hd)`` by the angles of
    ``cos, sin (N, hd / 2)``: same shape and dtype as ``x``. The products are taken in fp32 (the
    tables' dtype) and cast back, as diffusers' ``WanAttnProcessor``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class WanSelfAttention(Attention):
    """Wan's self-attention as a timm ``Attention``: ``qkv`` ``Linear(D, 3 D)`` (output
    ``[Q all heads | K | V]``, diffusers' ``to_q``/``to_k``/``to_v`` stacked), ``q_norm`` /
    ``k_norm`` RMSNorms over the whole width ``D`` (``rms_norm_across_heads``: diffusers'
    ``norm_q``/``norm_k``, applied before the split into heads), rotary positions, SDPA, ``proj``.

    ``forward(x (B, N, D), cos, sin (N, hd / 2)) -> (B, N, D)`` (:func:`rotary_freqs`).
    Because the norms span all heads, a head-parallel version needs the sum of squares over
    the tensor-parallel group; vitp's generic ``TPAttention`` does not apply
    (:class:`vitp.models.parallelize_wan.TPWanSelfAttention` does it).
    """

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6):
        super().__init__(dim, num_heads=num_heads, qkv_bias=True)
        self.q_norm = nn.RMSNorm(dim, eps=eps)
        self.k_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))  # (B, H, N, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        p = self.attn_drop.p if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.scale)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, -1)))


class WanCrossAttention(CrossAttention):
    """Wan's cross-attention to the text tokens, laid out as :class:`vitp.models.CrossAttention`
    (``q``, ``kv`` ``Linear(D, 2 D)`` packed ``[K | V]`` = diffusers' ``to_k``/``to_v`` stacked,
    ``proj``) with ``q_norm`` / ``k_norm`` RMSNorms over the whole width ``D`` (diffusers'
    ``norm_q``/``norm_k``). No rotary positions.

    ``forward(x (B, N, D), ctx (B, L, D), mask (B, L) bool or None) -> (B, N, D)``; Wan itself
    passes no mask (its pipeline zero-pads captions to 512 tokens and attends to all).
    """

    def __init__(self, dim: int, num_heads: int, eps: float = 1e-6):
        super().__init__(dim, num_heads, qkv_bias=True)
        self.q_norm = nn.RMSNorm(dim, eps=eps)
        self.k_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.proj_drop(self.proj(self.attend(self.q(x), self.kv(ctx), mask)))

    def attend(self, q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of ``q (B, N, h hd)`` over ``kv (B, L, 2 h hd)`` (``[K | V]``), ``mask (B, L)``
        or None: ``(B, N, h hd)`` before ``proj``. The norms take all ``D`` channels, so ``h`` must
        be every head, or a tensor-parallel rank's heads with norms that sum their statistic over
        the TP group (:mod:`vitp.models.parallelize_wan`)."""
        B, N, hd = q.shape[0], q.shape[1], self.head_dim
        k, v = kv.chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.unflatten(-1, (-1, hd)).transpose(1, 2) for t in (q, k, v))
        m = None if mask is None else mask[:, None, None, :].to(torch.bool)
        p = self.attn_drop.p if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, scale=self.scale)
        return o.transpose(1, 2).reshape(B, N, -1)


def per_sample_timestep(timestep: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """``timestep`` as the embedding takes it: ``(B,)`` as given; a per-token ``(B, N)`` (Wan 2.2
    TI2V's ``expand_timesteps``, ``N`` the tokens) as its first column ``(B,)`` when every token of
    a sample has the same timestep (text-to-video: the same computation, since diffusers' per-token
    rows are then all equal), else unchanged. Raises ``ValueError`` naming the shapes otherwise."""
    if timestep.dim() == 1 and timestep.shape[0] == batch:
        return timestep
    if timestep.dim() == 2 and tuple(timestep.shape) == (batch, tokens):
        return timestep[:, 0] if bool((timestep == timestep[:, :1]).all()) else timestep
    raise ValueError(f"timestep {tuple(timestep.shape)}: give one timestep per sample ({batch},) or one per token "
                     f"({batch}, {tokens}) (Wan 2.2 TI2V's expand_timesteps, N = the input's tokens)")


def _gelu_tanh() -> nn.Module:
    return nn.GELU(approximate="tanh")


class WanEmbed(nn.Module):
    """Input stage: ``(x (B, C, T, H, W), timestep (B,) in [0, 1000], text (B, L, text_dim))`` ->
    ``(tokens (B, N, D), temb (B, D), mod (B, 6, D), ctx (B, L, D), cos, sin (N, hd / 2))``.
    A per-token ``timestep (B, N)`` (Wan 2.2 TI2V, ``expand_timesteps``) gives ``temb (B, N, D)``
    and ``mod (B, N, 6, D)`` as diffusers' ``WanTimeTextImageEmbedding`` (``timestep_seq_len``),
    unless it is equal over each sample's tokens: then it is the ``(B,)`` of its first column
    (:func:`per_sample_timestep`).

    ``x_embedder``: the Conv3d patch embedding (diffusers' ``patch_embedding``); ``t_embedder``
    (:class:`WanTimestepEmbedder`, ``condition_embedder.time_embedder``) gives ``temb``, which
    the final layer modulates with; ``time_proj`` (SiLU, ``Linear(D, 6 D)``) gives every block's
    shared modulation ``mod`` (adaLN-single); ``y_embedder`` (timm ``Mlp``, GELU-tanh;
    ``condition_embedder.text_embedder``) projects the text to ``ctx``; ``cos``/``sin`` are the
    rotary tables of the grid (:func:`rotary_freqs`, cached for the last grid and device).

    Raises ``ValueError`` when ``x`` is not ``(B, in_channels, T, H, W)`` (:func:`check_latents`),
    does not tile into patches or its grid is not the set grid
    (:meth:`set_grid`), for a timestep that is neither ``(B,)`` nor ``(B, N)`` (``N`` the grid's
    tokens), or text that is not ``(B, L, text_dim)``.
    """

    def __init__(self, in_channels: int, width: int, patch_size: Tuple[int, int, int], text_dim: int,
                 freq_dim: int, head_dim: int, rope_max_seq_len: int = 1024, grid: Grid = (1, 1, 1)):
        super().__init__()
        self.pt, self.p = int(patch_size[0]), int(patch_size[1])
        self.text_dim, self.head_dim, self.rope_max_seq_len = text_dim, head_dim, rope_max_seq_len
        self.grid = tuple(int(g) for g in grid)
        self.x_embedder = TubeletEmbed(in_channels, width, self.p, self.pt)
        self.t_embedder = WanTimestepEmbedder(width, freq_dim)
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        self.y_embedder = Mlp(text_dim, width, width, act_layer=_gelu_tanh)
        self._rope: Dict[Any, Tuple[torch.Tensor, torch.Tensor]] = {}

    def set_grid(self, grid: Grid) -> None:
        """Take inputs of the token grid ``(gt, gh, gw)`` from now on."""
        self.grid = tuple(int(g) for g in grid)

    def rotary(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the set grid on ``device`` (:func:`rotary_freqs`; the last one kept)."""
        key = (self.grid, str(device))
        if key not in self._rope:
            self._rope = {key: rotary_freqs(self.grid, self.head_dim, self.rope_max_seq_len, device=device)}
        return self._rope[key]

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        check_latents(x, self.x_embedder.proj.in_channels)
        grid = input_grid(x.shape, self.p, self.pt)
        if grid != self.grid:
            raise ValueError(f"input token grid {grid} (of x {tuple(x.shape)}) differs from the set grid {self.grid}; "
                             "call vitp.models.set_grid(model, grid) first")
        B = x.shape[0]
        timestep = per_sample_timestep(timestep, B, math.prod(grid))
        if text.dim() != 3 or text.shape[0] != B or text.shape[-1] != self.text_dim:
            raise ValueError(f"encoder_hidden_states {tuple(text.shape)}: expected ({B}, L, {self.text_dim})")
        tokens = self.x_embedder(x.to(self.x_embedder.proj.weight.dtype))
        text = text.to(self.y_embedder.fc1.weight.dtype)
        temb = self.t_embedder(timestep).type_as(text)  # fp32 embedder (WanModel.cast), temb in the text's dtype
        mod = self.time_proj(temb).unflatten(-1, (6, -1))  # (B, 6, D), per token (B, N, 6, D)
        ctx = self.y_embedder(text)
        return (tokens, temb, mod, ctx, *self.rotary(x.device))


class WanBlock(nn.Module):
    """Wan transformer block (diffusers' ``WanTransformerBlock``):
    ``forward(x (B, N, D), mod (B, 6, D), ctx (B, L, D), cos, sin (N, hd / 2)) -> (B, N, D)``.

    ``shift, scale, gate`` (attention) and ``c_shift, c_scale, c_gate`` (MLP) are
    ``scale_shift_table (1, 6, D) + mod``, in fp32::

        x = x + gate * attn(norm1(x) * (1 + scale) + shift)
        x = x + cross_attn(norm2(x), ctx)
        x = x + c_gate * mlp(norm3(x) * (1 + c_scale) + c_shift)

    ``norm1``/``norm3`` affine-free, ``norm2`` affine (``cross_attn_norm``; the identity without
    it), all :class:`FP32LayerNorm`; ``attn`` :class:`WanSelfAttention`, ``cross_attn``
    :class:`WanCrossAttention`, ``mlp`` a timm ``Mlp`` (GELU-tanh; diffusers' ``ffn.net.0.proj``,
    ``ffn.net.2``). Residual sums are taken in fp32 as diffusers does. A per-token ``mod (B, N, 6,
    D)`` (Wan 2.2 TI2V) gives each token its own six ``(B, N, D)`` terms, as diffusers'
    ``WanTransformerBlock`` for ``temb.ndim == 4``.
    """

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float = 1e-6, cross_attn_norm: bool = True):
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn = WanSelfAttention(dim, num_heads, eps)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(dim, num_heads, eps)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.mlp = Mlp(dim, ffn_dim, act_layer=_gelu_tanh)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        shift, scale, gate, c_shift, c_scale, c_gate = modulation(self.scale_shift_table, mod)
        h = (self.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        x = (x.float() + self.attn(h, cos, sin) * gate).type_as(x)
        x = x + self.cross_attn(self.norm2(x.float()).type_as(x), ctx)
        h = (self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + self.mlp(h).float() * c_gate).type_as(x)


def modulation(table: torch.Tensor, mod: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The ``k`` modulation terms of ``table (1, k, D) + mod`` in fp32: each ``(B, 1, D)`` for
    ``mod (B, k, D)``, ``(B, N, D)`` for a per-token ``mod (B, N, k, D)`` (diffusers'
    ``unsqueeze(0)``, ``chunk(k, dim=2)``, ``squeeze(2)``)."""
    if mod.dim() == 3:
        return (table + mod.float()).chunk(table.shape[1], dim=1)
    return tuple(c.squeeze(2) for c in (table.unsqueeze(0) + mod.float()).chunk(table.shape[1], dim=2))


class WanFinal(nn.Module):
    """Output head: ``(x (B, N, D), temb (B, D)) -> (B, C, T, H, W)``: affine-free
    :class:`FP32LayerNorm` modulated by ``scale_shift_table (1, 2, D) + temb`` (shift, scale),
    ``linear`` (diffusers' ``proj_out``) to ``pt p p C`` values per token, unpatchify over the
    set grid. A per-token ``temb (B, N, D)`` (Wan 2.2 TI2V) modulates each token with its own."""

    def __init__(self, width: int, patch_size: Tuple[int, int, int], out_channels: int, eps: float = 1e-6,
                 grid: Grid = (1, 1, 1)):
        super().__init__()
        self.pt, self.p, self.C = int(patch_size[0]), int(patch_size[1]), out_channels
        self.grid = tuple(int(g) for g in grid)
        self.norm_final = FP32LayerNorm(width, eps, elementwise_affine=False)
        self.linear = nn.Linear(width, out_channels * self.pt * self.p * self.p)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, width) / width ** 0.5)

    def set_grid(self, grid: Grid) -> None:
        """Unpatchify to the token grid ``(gt, gh, gw)`` from now on."""
        self.grid = tuple(int(g) for g in grid)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = modulation(self.scale_shift_table, temb.unsqueeze(-2))
        x = self.linear((self.norm_final(x.float()) * (1 + scale) + shift).type_as(x))
        B, (gt, gh, gw) = x.shape[0], self.grid
        x = x.view(B, gt, gh, gw, self.pt, self.p, self.p, self.C)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, gt, pt, gh, p, gw, p)
        return x.reshape(B, self.C, gt * self.pt, gh * self.p, gw * self.p)


class WanModel(nn.Module):
    """Single-process Wan text-to-video transformer: ``embed`` (:class:`WanEmbed`), ``blocks``
    (:class:`WanBlock`), ``final`` (:class:`WanFinal`).

    ``forward(hidden_states (B, C, T, H, W), timestep (B,) or per token (B, N) in [0, 1000],
    encoder_hidden_states (B, L, text_dim)) -> (B, out_channels, T, H, W)``: the call of diffusers'
    ``WanTransformer3DModel`` (returning the tensor). The grid follows the input.

    ``config``: a :class:`WanConfig` or a diffusers ``config.json`` dict; keyword arguments
    override its keys. Weights are initialised at random (diffusers' ``scale_shift_table``
    init); :func:`vitp.models.wan_keys.from_pretrained` loads a diffusers folder. Raises
    ``ValueError`` for options vitp does not implement (:meth:`WanConfig.check`); ``forward``
    raises ``ValueError`` for inputs of another shape (:class:`WanEmbed`).
    """

    def __init__(self, config: Any = None, **options: Any):
        super().__init__()
        if not isinstance(config, WanConfig) or options:
            base = config.to_dict() if isinstance(config, WanConfig) else dict(config or {})
            config = WanConfig.from_dict({**base, **options})
        config.check()
        self.config, c = config, config
        self.embed = WanEmbed(c.in_channels, c.width, c.patch_size, c.text_dim, c.freq_dim, c.attention_head_dim,
                              c.rope_max_seq_len)
        self.blocks = nn.ModuleList(WanBlock(c.width, c.ffn_dim, c.num_attention_heads, c.eps, c.cross_attn_norm)
                                    for _ in range(c.num_layers))
        self.final = WanFinal(c.width, c.patch_size, c.out_channels, c.eps)

    def cast(self, dtype: torch.dtype) -> "WanModel":
        """Parameters to ``dtype`` except those diffusers keeps in fp32 under bf16/fp16 weights
        (``WanTransformer3DModel._keep_in_fp32_modules``: the timestep embedder, every
        ``scale_shift_table``, ``norm1``/``norm2``/``norm3``), so a bf16 model computes as
        diffusers' bf16 model. ``dtype``: a floating ``torch.dtype`` or its name (``"bfloat16"``,
        ``"bf16"``, ...). Returns the model. Raises ``ValueError`` for another dtype (e.g.
        ``torch.int8``: quantisation is not a cast) or an unknown name (:func:`float_dtype`)."""
        dtype = float_dtype(dtype)
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if any(k in name for k in FP32_KEEP) else dtype)
        return self

    def set_grid(self, grid: Grid) -> None:
        """Set the token grid ``(gt, gh, gw)`` of the input stage, the output head and every other
        submodule with a ``set_grid`` of its own (a tensor/context-parallel attention's token
        count and grid, :mod:`vitp.models.parallelize_wan`)."""
        grid = tuple(int(g) for g in grid)
        for m in self.modules():
            if m is not self and callable(getattr(m, "set_grid", None)):
                m.set_grid(grid)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        check_latents(hidden_states, self.config.in_channels)
        grid = input_grid(hidden_states.shape, self.embed.p, self.embed.pt)
        if grid != self.embed.grid:  # another size than the last call: follow the input
            self.set_grid(grid)
        x, temb, mod, ctx, cos, sin = self.embed(hidden_states, timestep, encoder_hidden_states)
        for blk in self.blocks:
            x = blk(x, mod, ctx, cos, sin)
        return self.final(x, temb)
