"""Flow matching with x-prediction and v-loss (the training objective; samplers in :mod:`.samplers`).

Linear path with ``t=0`` noise and ``t=1`` data: ``z_t = t * x + (1 - t) * s * eps`` where ``s``
is the noise scale. The network predicts ``x``; the loss compares velocities
``v_pred = (x_pred - z_t) / max(1 - t, t_eps)`` and ``v = x - s * eps`` (Li & He 2025, "Back to
Basics: Let Denoising Generative Models Denoise", arXiv 2511.13720; JiT reference code).
``t ~ sigmoid(N(P_mean, P_std))`` (logit-normal, Esser et al. 2024), or with probability
``t_uniform`` ``t ~ U(0, 1)``: the logit-normal almost never draws ``t > 0.9`` (the last sampler
steps), where an x-predicting network left untrained returns worse than its input.

All randomness of a training sample (``t``, ``eps``, the CFG label drop) is drawn from a
generator seeded by ``(seed, step, position in the global batch)``: the same sample gets the
same noise at any (micro-batch, accumulation, dp) split, on every TP rank and pipeline stage.
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn


def sample_seed(*keys: int) -> int:
    """Mix integer keys into a 63-bit seed (NumPy ``SeedSequence``, stable across processes)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0]) >> 1


def draw_sample_noise(
    shape: Sequence[int], seed: int, cfg: Any, num_classes: int, y: int
) -> Tuple[torch.Tensor, float, int]:
    """Draw ``(eps (shape), t, y_in)`` for one sample from its own generator.

    ``y_in`` is ``y`` or, with probability ``cfg.label_drop``, the null class ``num_classes``;
    ``t`` is logit-normal or, with probability ``cfg.t_uniform``, uniform in ``[0, 1)``.
    """
    g = torch.Generator().manual_seed(seed)
    t = torch.sigmoid(torch.randn((), generator=g) * cfg.P_std + cfg.P_mean).item()
    drop = torch.rand((), generator=g).item() < cfg.label_drop
    eps = torch.randn(tuple(shape), generator=g)
    t_uniform = getattr(cfg, "t_uniform", 0.0)
    if t_uniform > 0:  # drawn last, so runs without it keep every other draw
        u = torch.rand(2, generator=g)
        t = u[1].item() if u[0].item() < t_uniform else t
    return eps, t, (num_classes if drop else y)


def make_pair(
    x: torch.Tensor, y: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, y_in: torch.Tensor, noise_scale: float
) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """Build the DeepSpeed pipeline pair.

    Parameters
    ----------
    x : (B, C, T, H, W) data in [-1, 1];  eps : same shape, unit Gaussian;  t : (B,) in (0, 1)
    y : (B,) true labels (unused by the loss, kept for the caller);  y_in : (B,) labels after CFG drop

    Returns
    -------
    inputs ``(z_t, t, y_in)`` for the first stage and targets ``(x, z_t, t)`` for the loss.
    """
    tt = t.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
    z_t = tt * x + (1 - tt) * noise_scale * eps
    return (z_t, t, y_in), (x, z_t, t)


def velocity(x_pred: torch.Tensor, z_t: torch.Tensor, t: torch.Tensor, t_eps: float) -> torch.Tensor:
    """``v = (x_pred - z_t) / max(1 - t, t_eps)``; ``t`` is (B,) and broadcast over the rest."""
    denom = (1 - t).clamp_min(t_eps).view(-1, *([1] * (x_pred.ndim - 1)))
    return (x_pred - z_t) / denom.to(x_pred.dtype)


def v_loss(x_pred: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor, t: torch.Tensor, t_eps: float) -> torch.Tensor:
    """Per-sample v-loss ``(B,)`` in fp32: the mean over all but the batch dim of
    ``(velocity(x_pred) - velocity(x))**2`` at ``(z_t, t)``; ``x_pred``, ``x``, ``z_t`` are
    ``(B, ...)`` of one shape, ``t`` is ``(B,)``."""
    x_pred, x, z_t = x_pred.float(), x.float(), z_t.float()
    return (velocity(x_pred, z_t, t, t_eps) - velocity(x, z_t, t, t_eps)).pow(2).flatten(1).mean(1)


class FlowMatchingLoss(nn.Module):
    """v-loss from an x-prediction. ``forward(x_pred, (x, z_t, t)) -> scalar``.

    ``v = (x - z_t) / max(1 - t, t_eps)`` is the clipped target velocity (``x - s*eps`` wherever
    ``1 - t >= t_eps``, as in JiT). The loss is computed in fp32. The per-sample losses and their
    ``t`` of the last forward passes are kept (detached) in :attr:`records` so the trainer can log
    loss per ``t`` bin; call :meth:`pop_records` to collect and clear them.
    """

    def __init__(self, t_eps: float):
        super().__init__()
        self.t_eps = t_eps
        self.records: list = []

    def per_sample(self, x_pred: torch.Tensor, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``(B,)`` (:func:`v_loss`)."""
        x, z_t, t = targets
        return v_loss(x_pred, x, z_t, t, self.t_eps)

    def forward(self, x_pred: torch.Tensor, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        per = self.per_sample(x_pred, targets)
        self.records.append((targets[2].detach().float().cpu(), per.detach().cpu()))
        return per.mean()

    def pop_records(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(t (M,), loss (M,))`` of all samples since the last call."""
        if not self.records:
            return torch.zeros(0), torch.zeros(0)
        t, loss = (torch.cat(v) for v in zip(*self.records))
        self.records.clear()
        return t, loss
