"""Model FLOPs of a training step, counted from the config (the MFU numerator).

Convention (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1; PaLM,
Chowdhery et al. 2022, appendix B; Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters", §5.1): a multiply-add is 2 FLOPs, backward costs twice the forward,
so training = 3 x forward; activation recomputation is *not* counted (model FLOPs, not hardware
FLOPs), nor are norms, activations and other element-wise work. Per sample:

- every token passes the block linears: ``2 N (D*3D + D*D + mlp)`` with ``mlp = 2 D h`` (GELU:
  fc1, fc2) or ``3 D h`` (SwiGLU: fc1_g, fc1_x, fc2) -- the "6 N_params tokens" term, counted from
  the weights each token actually meets;
- attention scores and values: ``2 * 2 N S D`` per block, where S is the number of keys per query:
  N for full attention (PaLM's ``12 L H Q T`` per token for fwd+bwd; no causal halving in a ViT),
  gh*gw for a factorized spatial block, gt for a temporal one (Latte), counted separately;
- per-sample linears (adaLN modulation ``2 D 6D`` per block, final adaLN ``2 D 2D``, timestep MLP)
  count once per sample, not per token;
- the tubelet embedding and the output linear: ``2 N D (pt p p C)`` each;
- text conditioning (PixArt-alpha's cross-attention, ``L`` caption tokens of ``Dc`` channels):
  per block ``2 N (2 D^2)`` (q, proj), ``2 L (2 D^2)`` (kv), ``4 N L D`` (scores, values); the
  caption projection ``2 L (Dc D + D^2)`` and pooling ``2 D^2`` once per sample.

Wan (diffusers' ``WanTransformer3DModel``; Wan, arXiv 2503.20314; ``shape.is_wan``): the same
block linears (self-attention ``qkv`` + ``proj``, cross-attention ``q`` + ``proj`` per token and
``kv`` per caption token, FFN ``2 D F`` with ``F = ffn_dim``) and attention terms, with ``L = 512``
caption tokens; its modulation is adaLN-single: one ``time_proj`` ``2 D 6D`` per sample in the
embedding and none per block (each block adds its ``scale_shift_table``) nor in the output head;
the caption projection ``2 L (Dc D + D^2)`` has no pooling.
"""
from __future__ import annotations

from typing import Any, Dict

from .shapes import ModelShape, model_cache

FREQ_DIM = 256  # sinusoid size of the timestep embedder (vitp.models.layers.TimestepEmbedder)


def block_forward_flops(shape: ModelShape, kind: str) -> Dict[str, float]:
    """Forward FLOPs of one block for one sample: ``{"linear", "attention", "per_sample"}``."""
    N, D, h = shape.tokens, shape.width, shape.hidden
    mlp = (2 if shape.mlp == "gelu" else 3) * D * h
    L = shape.text_tokens
    return {"linear": 2.0 * N * (4 * D * D + mlp) + (2.0 * N * 2 * D * D + 2.0 * L * 2 * D * D if L else 0.0),
            "attention": 4.0 * N * shape.attention_span(kind) * D + 4.0 * N * L * D,
            "per_sample": 0.0 if shape.is_wan else 2.0 * D * 6 * D}


def embed_forward_flops(shape: ModelShape) -> float:
    """Forward FLOPs of the input layer for one sample (tubelet Conv3d + timestep MLP, caption
    projection; Wan: plus the shared modulation ``time_proj``, no caption pooling)."""
    D, L = shape.width, shape.text_tokens
    text = 2.0 * L * (shape.text_dim * D + D * D) + (2.0 * D * 6 * D if shape.is_wan else 2.0 * D * D if L else 0.0)
    return 2.0 * shape.tokens * D * shape.patch_values + 2.0 * (FREQ_DIM * D + D * D) + text


def final_forward_flops(shape: ModelShape) -> float:
    """Forward FLOPs of the output layer for one sample (adaLN + linear to pixels; Wan: no adaLN
    linear, its ``scale_shift_table`` is added to ``temb``)."""
    D = shape.width
    return 2.0 * shape.tokens * D * shape.patch_values + (0.0 if shape.is_wan else 2.0 * D * 2 * D)


@model_cache(256)
def forward_flops_per_sample(model: Any) -> float:
    """Forward model FLOPs of one sample of the ``model`` config section (remembered per model)."""
    shape = ModelShape.from_config(model)
    blocks = sum(sum(block_forward_flops(shape, shape.block_kind(i)).values()) for i in range(shape.depth))
    return blocks + embed_forward_flops(shape) + final_forward_flops(shape)


def model_flops_per_step(model: Any, batch: int) -> float:
    """Training model FLOPs of one optimizer step over ``batch`` samples (the global batch):
    ``3 x forward`` (see the module docstring). Tokens per sample follow the config (resolution,
    frames, patch and tubelet sizes)."""
    return 3.0 * batch * forward_flops_per_sample(model)
