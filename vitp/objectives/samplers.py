"""ODE samplers of the flow (Euler, Heun) with classifier-free guidance and a guidance interval.

The flow runs from noise at ``t = 0`` to data at ``t = 1`` along the velocity derived from the
network's x-prediction (:func:`vitp.objectives.flow.velocity`); Heun's method on all steps but the
last, which is Euler, as in JiT (Li & He 2025, arXiv 2511.13720). Guidance ``v_u + w (v_c - v_u)``
(Ho & Salimans 2022) applies only for ``t`` in an interval (Kynkaanniemi et al. 2024, "Applying
Guidance in a Limited Interval Improves Sample and Distribution Quality in Diffusion Models",
arXiv 2404.07724), with JiT's boundary rule: guided where ``lo < t < hi``, and at ``t = 0`` too
when ``lo = 0``. The rule is decided on the exact grid ``t_k = k / steps`` so that a bound on the grid
(``lo = 0.1`` at 20 steps) is excluded as in JiT, not included or excluded by float32 rounding.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .flow import velocity

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def guided(t: float, cfg_interval: Sequence[float]) -> bool:
    """Whether guidance applies at time ``t`` (0 = noise, 1 = data) for ``cfg_interval = (lo, hi)``:
    ``lo < t < hi``, or ``t = 0`` when ``lo = 0`` (JiT, Li & He 2025; the sampler never evaluates
    ``t = 1``, so ``(0, 1)`` guides every evaluation)."""
    lo, hi = float(cfg_interval[0]), float(cfg_interval[1])
    return t < hi and (lo == 0 or t > lo)


def _placement(model: Denoiser) -> Tuple[torch.device, torch.dtype]:
    """Device and dtype of a module's parameters, or a denoiser's ``.device`` / ``.dtype``
    (:class:`vitp.eval.inference.StageDenoiser`); CPU fp32 otherwise."""
    p = next(iter(model.parameters())) if isinstance(model, nn.Module) else None
    if p is not None:
        return p.device, p.dtype
    return getattr(model, "device", torch.device("cpu")), getattr(model, "dtype", torch.float32)


@torch.no_grad()
def sample(
    model: Denoiser,
    y: Union[torch.Tensor, Tuple[torch.Tensor, ...]],
    shape: Sequence[int],
    *,
    num_classes: Optional[int] = None,
    null: Optional[Tuple[torch.Tensor, ...]] = None,
    steps: int = 20,
    method: str = "heun",
    cfg_scale: float = 1.0,
    cfg_interval: Sequence[float] = (0.0, 1.0),
    noise_scale: float = 1.0,
    t_eps: float = 0.05,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    on_step: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """Integrate the flow ODE from noise (``t=0``) to data (``t=1``): ``(B, C, T, H, W)`` samples,
    clamped to [-1, 1]; ``on_step()`` is called after each of the ``steps`` intervals (a progress bar).

    Parameters
    ----------
    model : callable ``(z_t (B, C, T, H, W), t (B,), *y) -> x_pred`` (e.g. :class:`vitp.models.Generator`)
    y : (B,) int64 class labels (``num_classes`` = unconditional), or a tuple of conditioning
        tensors with batch dimension B (a caption's embeddings ``(B, L, Dc)`` and mask ``(B, L)``)
    num_classes, null : the unconditional input of classifier-free guidance: the null class
        ``num_classes`` for labels, or ``null``, a tuple like ``y`` with batch dimension 1 (the
        encoded empty caption), repeated over the batch
    shape : ``(C, T, H, W)`` of one sample
    steps : number of intervals of the uniform t grid
    method : ``"euler"`` or ``"heun"`` (Heun on all steps but the last, which is Euler, as in JiT)
    cfg_scale, cfg_interval : classifier-free guidance ``v_u + w (v_c - v_u)`` applied only where
        :func:`guided` says (``lo < t < hi``, plus ``t = 0`` when ``lo = 0``; Kynkaanniemi et al.
        2024 guidance interval, JiT's boundaries); ``(0, 1)`` guides every step

    Raises
    ------
    ValueError on an unknown method or ``steps < 1``, or guidance without its null input.
    """
    if method not in ("euler", "heun"):
        raise ValueError(f"sampler.method={method!r} is not supported; use 'euler' or 'heun'")
    if steps < 1:
        raise ValueError(f"sampler.steps must be >= 1, got {steps}")
    device, dtype = _placement(model)
    y = tuple(v.to(device) for v in (y if isinstance(y, (tuple, list)) else (y,)))
    B = y[0].shape[0]
    if noise is None:
        noise = torch.randn((B, *shape), generator=generator)
    z = (noise_scale * noise).to(device=device, dtype=torch.float32)
    use_cfg = cfg_scale != 1.0
    if use_cfg:
        if null is None and num_classes is None:
            raise ValueError("classifier-free guidance (sampler.cfg_scale != 1) needs the null input: num_classes or null")
        null = (torch.full_like(y[0], num_classes),) if null is None else \
            tuple(v.to(device).expand(B, *v.shape[1:]) for v in null)
        pair = tuple(torch.cat([c, u]) for c, u in zip(y, null))

    def v_at(z: torch.Tensor, k: int) -> torch.Tensor:  # velocity at grid point t_k
        tb = torch.full((B,), ts[k], device=device)
        w = cfg_scale if guided(k / steps, cfg_interval) else 1.0
        if use_cfg and w != 1.0:
            x_pred = model(torch.cat([z, z]).to(dtype), torch.cat([tb, tb]).to(dtype), *pair).float()
            v_c, v_u = velocity(x_pred, torch.cat([z, z]), torch.cat([tb, tb]), t_eps).chunk(2)
            return v_u + w * (v_c - v_u)
        return velocity(model(z.to(dtype), tb.to(dtype), *y).float(), z, tb, t_eps)

    ts = torch.linspace(0.0, 1.0, steps + 1).tolist()
    for i in range(steps):
        t0, t1 = ts[i], ts[i + 1]
        v0 = v_at(z, i)
        if method == "heun" and i < steps - 1:
            z_e = z + (t1 - t0) * v0
            z = z + (t1 - t0) * 0.5 * (v0 + v_at(z_e, i + 1))
        else:
            z = z + (t1 - t0) * v0
        if on_step is not None:
            on_step()
    return z.clamp(-1, 1)
