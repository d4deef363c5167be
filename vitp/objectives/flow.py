"""Flow matching with x-prediction and v-loss, and its ODE samplers.

Linear path with ``t=0`` noise and ``t=1`` data: ``z_t = t * x + (1 - t) * s * eps`` where ``s``
is the noise scale. The network predicts ``x``; the loss compares velocities
``v_pred = (x_pred - z_t) / max(1 - t, t_eps)`` and ``v = x - s * eps`` (Li & He 2025, "Back to
Basics: Let Denoising Generative Models Denoise", arXiv 2511.13720; JiT reference code).
``t ~ sigmoid(N(P_mean, P_std))`` (logit-normal, Esser et al. 2024).

All randomness of a training sample (``t``, ``eps``, the CFG label drop) is drawn from a
generator seeded by ``(seed, step, position in the global batch)``: the same sample gets the
same noise at any (micro-batch, accumulation, dp) split, on every TP rank and pipeline stage.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

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

    ``y_in`` is ``y`` or, with probability ``cfg.label_drop``, the null class ``num_classes``.
    """
    g = torch.Generator().manual_seed(seed)
    t = torch.sigmoid(torch.randn((), generator=g) * cfg.P_std + cfg.P_mean).item()
    drop = torch.rand((), generator=g).item() < cfg.label_drop
    eps = torch.randn(tuple(shape), generator=g)
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
        """Per-sample loss ``(B,)``."""
        x, z_t, t = targets
        x_pred, x, z_t = x_pred.float(), x.float(), z_t.float()
        v_pred = velocity(x_pred, z_t, t, self.t_eps)
        v = velocity(x, z_t, t, self.t_eps)
        return (v_pred - v).pow(2).flatten(1).mean(1)

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


Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def sample(
    model: Denoiser,
    y: torch.Tensor,
    shape: Sequence[int],
    *,
    num_classes: int,
    steps: int = 20,
    method: str = "heun",
    cfg_scale: float = 1.0,
    cfg_interval: Sequence[float] = (0.0, 1.0),
    noise_scale: float = 1.0,
    t_eps: float = 0.05,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Integrate the flow ODE from noise (``t=0``) to data (``t=1``).

    Parameters
    ----------
    model : callable ``(z_t (B, C, T, H, W), t (B,), y (B,)) -> x_pred`` (e.g. :class:`Generator`)
    y : (B,) int64 class labels (``num_classes`` = unconditional)
    shape : ``(C, T, H, W)`` of one sample
    steps : number of intervals of the uniform t grid
    method : ``"euler"`` or ``"heun"`` (Heun on all steps but the last, which is Euler, as in JiT)
    cfg_scale, cfg_interval : classifier-free guidance ``v_u + w (v_c - v_u)`` applied only for
        ``t`` in ``[lo, hi]`` (Kynkaanniemi et al. 2024, guidance interval)

    Returns
    -------
    (B, C, T, H, W) samples, clamped to [-1, 1].

    Raises
    ------
    ValueError on an unknown method or ``steps < 1``.
    """
    if method not in ("euler", "heun"):
        raise ValueError(f"sampler.method={method!r} is not supported; use 'euler' or 'heun'")
    if steps < 1:
        raise ValueError(f"sampler.steps must be >= 1, got {steps}")
    p = next(iter(model.parameters())) if isinstance(model, nn.Module) else None
    device = p.device if p is not None else torch.device("cpu")
    dtype = p.dtype if p is not None else torch.float32
    B = y.shape[0]
    y = y.to(device)
    if noise is None:
        noise = torch.randn((B, *shape), generator=generator)
    z = (noise_scale * noise).to(device=device, dtype=torch.float32)
    null = torch.full_like(y, num_classes)
    guided = cfg_scale != 1.0

    def v_at(z: torch.Tensor, t: float) -> torch.Tensor:
        tb = torch.full((B,), t, device=device)
        w = cfg_scale if cfg_interval[0] <= t <= cfg_interval[1] else 1.0
        if guided and w != 1.0:
            x_pred = model(torch.cat([z, z]).to(dtype), torch.cat([tb, tb]).to(dtype), torch.cat([y, null])).float()
            v_c, v_u = velocity(x_pred, torch.cat([z, z]), torch.cat([tb, tb]), t_eps).chunk(2)
            return v_u + w * (v_c - v_u)
        return velocity(model(z.to(dtype), tb.to(dtype), y).float(), z, tb, t_eps)

    ts = torch.linspace(0.0, 1.0, steps + 1).tolist()
    for i in range(steps):
        t0, t1 = ts[i], ts[i + 1]
        v0 = v_at(z, t0)
        if method == "heun" and i < steps - 1:
            z_e = z + (t1 - t0) * v0
            z = z + (t1 - t0) * 0.5 * (v0 + v_at(z_e, t1))
        else:
            z = z + (t1 - t0) * v0
    return z.clamp(-1, 1)
