"""Temporal statistics of video samples against real clips (flicker / frozen video)."""
from __future__ import annotations

from typing import Dict, Optional

import torch


@torch.no_grad()
def temporal_consistency(x: torch.Tensor, clamp: bool = True) -> float:
    """Mean absolute difference between consecutive frames, ``mean |x[:, :, t+1] - x[:, :, t]|``
    over all samples, channels, pixels and the ``T - 1`` frame pairs (float64 accumulation).

    ``x``: ``(B, C, T, H, W)`` in ``[-1, 1]`` (clamped first when ``clamp``, as the previews
    are). Units: the ``[-1, 1]`` data range, so the value lies in ``[0, 2]``; multiply by 127.5
    for 8-bit levels. 0 means a static video; a linear ramp ``x_t = a + b t`` gives ``|b|``.
    Not a quality score by itself: compare samples with real clips
    (:func:`temporal_metrics`) -- too low is frozen video, too high is flicker.

    Raises ``ValueError`` for a non-5-D input or fewer than 2 frames.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        raise ValueError(f"temporal_consistency needs a (B, C, T, H, W) tensor, got "
                         f"{tuple(x.shape) if hasattr(x, 'shape') else type(x).__name__}")
    if x.shape[2] < 2:
        raise ValueError(f"temporal_consistency needs at least 2 frames (T >= 2), got T = {x.shape[2]}; "
                         "images (T = 1) have no temporal statistic")
    if x.numel() == 0:
        raise ValueError(f"temporal_consistency got an empty tensor of shape {tuple(x.shape)}")
    v = x.detach().double()
    if clamp:
        v = v.clamp(-1, 1)
    return (v[:, :, 1:] - v[:, :, :-1]).abs().mean().item()


def temporal_metrics(samples: torch.Tensor, real: torch.Tensor) -> Dict[str, float]:
    """:func:`temporal_consistency` of generated ``samples`` and of ``real`` clips (both
    ``(B, C, T, H, W)`` in ``[-1, 1]``, same ``T`` for a fair comparison) and their ratio:

    ``{"temporal_diff": samples, "temporal_diff_real": real, "temporal_diff_ratio": samples / real}``

    A ratio near 1 means samples move as much as real footage; < 1 too static, > 1 flicker.
    The ratio uses ``max(real, 1e-12)`` so static real clips do not divide by zero.
    """
    s, r = temporal_consistency(samples), temporal_consistency(real)
    return {"temporal_diff": s, "temporal_diff_real": r, "temporal_diff_ratio": s / max(r, 1e-12)}


@torch.no_grad()
def temporal_sums(x: Optional[torch.Tensor]) -> torch.Tensor:
    """``[sum, count]`` (float64) of the frame-to-frame absolute differences of ``x``
    ``(B, C, T, H, W)`` clamped to ``[-1, 1]``: :func:`temporal_consistency` is ``sum / count``,
    and sums of batches add up (``[0, 0]`` for ``None`` or no samples)."""
    if x is None or x.numel() == 0:
        return torch.zeros(2, dtype=torch.float64)
    d = (x[:, :, 1:].double().clamp(-1, 1) - x[:, :, :-1].double().clamp(-1, 1)).abs()
    return torch.tensor([d.sum().item(), float(d.numel())], dtype=torch.float64)


def temporal_ratio(samples: torch.Tensor, real: torch.Tensor) -> Dict[str, float]:
    """:func:`temporal_metrics` from the :func:`temporal_sums` of the samples and of the real clips."""
    s, r = (v[0].item() / max(v[1].item(), 1.0) for v in (samples, real))
    return {"temporal_diff": s, "temporal_diff_real": r, "temporal_diff_ratio": s / max(r, 1e-12)}
