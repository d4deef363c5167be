"""Wan's flow-matching objective: velocity prediction on the rectified-flow path (sampling in :mod:`.wan_sampling`).

Wan (Wan Team 2025, arXiv 2503.20314) trains on the straight path of flow matching /
rectified flow (Lipman et al. 2022, arXiv 2210.02747; Liu et al. 2022, arXiv 2209.03003) in
diffusers' direction, ``s = 0`` data and ``s = 1`` noise::

    x_t = (1 - s) x + s eps,   target v = eps - x,   model timestep 1000 s,

and the network predicts ``v`` (diffusers' ``FlowMatchEulerDiscreteScheduler`` and the flow
``UniPCMultistepScheduler`` step with exactly this ``v``). This is the opposite time direction
to :mod:`.flow` (``t = 1`` data there) and a velocity, not an x-prediction.

Training noise levels, as the public Wan fine-tuners draw them: ``u`` uniform in [0, 1)
(DiffSynth-Studio ``diffsynth/diffusion/loss.py`` ``FlowMatchSFTLoss``, a uniform index into
1000 shifted levels; finetrainers ``finetrainers/utils/diffusion_utils.py`` ``prepare_sigmas``,
default ``flow_weighting_scheme="none"``) or logit-normal ``u = sigmoid(N(m, sd))`` (SD3, Esser
et al. 2024, arXiv 2403.03206, Sec. 3.1; musubi-tuner ``src/musubi_tuner/hv_train_network.py``
``--timestep_sampling shift``), then shifted as the sampling schedule is (SD3's timestep shift, Sec. 5.3.2)::

    s = shift u / (1 + (shift - 1) u)

with ``shift`` the pipeline scheduler's ``flow_shift`` by default (:meth:`WanFlowLoss.from_pipeline`).
Draws here are continuous (DiffSynth-Studio rounds to a grid of 1000 levels). ``sigma_range``
restricts ``s`` to ``[lo, hi]`` keeping the distribution's shape there (a Wan 2.2 expert is
trained on its side of the boundary), by inverse-CDF sampling.

Loss weighting: ``"none"`` (finetrainers' and musubi-tuner's default) or ``"bell"``, the weight
DiffSynth-Studio multiplies every Wan loss by (``diffsynth/diffusion/flow_match.py``
``FlowMatchScheduler.set_training_weight``): ``y(t) = exp(-2 ((t - 500) / 1000)^2)`` at ``t =
1000 s``, minus its minimum over the 1000 training levels ``shift(1 - k/1000)``, scaled to mean 1
over those levels. The loss is the MSE in fp32 of each sample, weighted, averaged over the batch.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

SAMPLINGS = ("uniform", "logit_normal")
WEIGHTINGS = ("none", "bell")
NUM_TRAIN_TIMESTEPS = 1000  # diffusers' Wan schedulers: model timestep = 1000 * sigma
Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
log = logging.getLogger(__name__)


def shift_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """``s = shift u / (1 + (shift - 1) u)``: maps [0, 1] onto [0, 1], moving mass to high noise for
    ``shift > 1`` (SD3, Esser et al. 2024, Sec. 5.3.2; diffusers' flow schedulers). ``logit(s) =
    logit(u) + log(shift)``. Any shape; raises ``ValueError`` for ``shift <= 0``."""
    if shift <= 0:
        raise ValueError(f"flow shift must be > 0, got {shift}")
    return shift * u / (1 + (shift - 1) * u)


def unshift_sigma(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of :func:`shift_sigma`: ``u = s / (shift - (shift - 1) s)``."""
    return s / (shift - (shift - 1) * s)


def noisy_input(x: torch.Tensor, eps: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, timestep)``: ``x_t = (1 - s) x + s eps`` computed in fp32 and returned in ``x``'s dtype,
    ``timestep = 1000 s`` (fp32, diffusers' scale).

    ``x``, ``eps``: ``(B, ...)`` of one shape (latents ``(B, C, T, H, W)``); ``s``: ``(B,)`` in [0, 1].
    Raises ``ValueError`` on mismatched shapes, or noise levels ``s`` outside [0, 1] (NaN included):
    ``s`` is the noise fraction, not a timestep in [0, 1000].
    """
    if x.shape != eps.shape or s.shape != x.shape[:1]:
        raise ValueError(f"x {tuple(x.shape)} and eps {tuple(eps.shape)} must match and s {tuple(s.shape)} be (B,)")
    outside = ~((s >= 0) & (s <= 1))
    if outside.any():
        raise ValueError(f"noise levels s {s[outside].tolist()[:4]} lie outside [0, 1]: s is the noise fraction "
                         "(0 data, 1 noise), not a timestep in [0, 1000]; give timestep / 1000, or draw it with "
                         "WanFlowLoss.draw_sigmas")
    ss = s.float().view(-1, *([1] * (x.ndim - 1)))
    x_t = (1 - ss) * x.float() + ss * eps.float()
    return x_t.to(x.dtype), s.float() * NUM_TRAIN_TIMESTEPS


def velocity_target(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The regression target ``v = eps - x = d x_t / d s`` in fp32, shape of ``x``."""
    return eps.float() - x.float()


def bell_weights(s: torch.Tensor, shift: float) -> torch.Tensor:
    """DiffSynth-Studio's Wan loss weight at noise levels ``s`` ``(B,)`` (fp32, ``(B,)``): ``y(1000 s)
    - y_min`` over the mean of ``y - y_min`` on the 1000 training levels ``shift(1 - k/1000)``,
    ``y(t) = exp(-2 ((t - 500) / 1000)^2)``; so the weight averages 1 under DiffSynth's uniform
    draw, peaks at ``t = 500`` and is 0 at ``s = 1``."""
    def y(t):
        return torch.exp(-2 * ((t - 500) / 1000) ** 2)

    grid = y(1000 * shift_sigma(1 - torch.arange(1000, dtype=torch.float64) / 1000, shift))
    lo = grid.min()
    return ((y(1000 * s.double()) - lo) / (grid - lo).mean()).float()


def loss_weights(s: torch.Tensor, weighting: str, shift: float) -> torch.Tensor:
    """Per-sample weights ``(B,)`` fp32 at noise levels ``s`` ``(B,)``: ones for ``"none"``,
    :func:`bell_weights` for ``"bell"``. Raises ``ValueError`` on another name."""
    if weighting == "none":
        return torch.ones(s.shape, dtype=torch.float32, device=s.device)
    if weighting == "bell":
        return bell_weights(s, shift)
    raise ValueError(f"objective weighting={weighting!r} is not supported; use one of {WEIGHTINGS}")


def flow_loss(pred: torch.Tensor, x: torch.Tensor, eps: torch.Tensor, s: torch.Tensor,
              weighting: str = "none", shift: float = 1.0) -> torch.Tensor:
    """Per-sample loss ``(B,)`` fp32: ``w(s) * mean((pred - (eps - x))^2)`` over all but the batch dim.

    ``pred``, ``x``, ``eps``: ``(B, ...)`` of one shape (``pred`` the model's velocity at
    :func:`noisy_input`); ``s``: ``(B,)``; ``weighting``, ``shift``: :func:`loss_weights`.
    Raises ``ValueError`` on mismatched shapes or an unknown weighting.
    """
    if pred.shape != x.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and data {tuple(x.shape)} must have one shape")
    per = (pred.float() - velocity_target(x, eps)).pow(2).flatten(1).mean(1)
    return per * loss_weights(s, weighting, shift).to(per.device)


def wan_loss(denoiser: Denoiser, x: torch.Tensor, eps: torch.Tensor, s: torch.Tensor, text: torch.Tensor,
             weighting: str = "none", shift: float = 1.0) -> torch.Tensor:
    """The scalar training loss of one batch: the batch mean of :func:`flow_loss` with ``pred =
    denoiser(x_t, 1000 s, text)`` at :func:`noisy_input` ``(x, eps, s)``.

    ``denoiser``: ``(x_t (B, C, T, H, W), timestep (B,) in [0, 1000], text (B, L, text_dim)) ->
    (B, C, T, H, W)`` (:class:`vitp.models.wan.WanModel`, or diffusers' model returning a tensor);
    ``x_t`` is given in the dtype of ``x``. Errors as :func:`noisy_input` and :func:`flow_loss`.
    """
    x_t, timestep = noisy_input(x, eps, s)
    return flow_loss(denoiser(x_t, timestep, text), x, eps, s, weighting, shift).mean()


def _check_draw(sampling: str, shift: float, logit_std: float, sigma_range: Sequence[float]) -> None:
    lo, hi = (float(v) for v in sigma_range)
    if sampling not in SAMPLINGS:
        raise ValueError(f"objective sampling={sampling!r} is not supported; use one of {SAMPLINGS}")
    if shift <= 0 or logit_std <= 0:
        raise ValueError(f"flow shift ({shift}) and logit_std ({logit_std}) must be > 0")
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"sigma_range must satisfy 0 <= lo < hi <= 1, got {list(sigma_range)}")


def sigma_cdf(s: torch.Tensor, sampling: str, shift: float, logit_mean: float = 0.0,
              logit_std: float = 1.0) -> torch.Tensor:
    """The CDF ``P(sigma <= s)`` of the shifted draw (float64, shape of ``s``): ``unshift(s)`` for
    ``"uniform"``; ``Phi((logit(s) - log(shift) - m) / sd)`` for ``"logit_normal"``."""
    u = unshift_sigma(s.double(), shift)
    if sampling == "uniform":
        return u
    return torch.special.ndtr((torch.logit(u) - logit_mean) / logit_std)


def sigma_icdf(q: torch.Tensor, sampling: str, shift: float, logit_mean: float = 0.0,
               logit_std: float = 1.0) -> torch.Tensor:
    """The inverse of :func:`sigma_cdf`: ``shift(u(q))`` with ``u = q`` (uniform) or ``u =
    sigmoid(m + sd Phi^-1(q))`` (logit-normal); float64, shape of ``q`` in [0, 1]."""
    q = q.double()
    u = q if sampling == "uniform" else torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(q))
    return shift_sigma(u, shift)


def draw_sigmas(n: int, generator: Optional[torch.Generator] = None, *, sampling: str = "uniform",
                shift: float = 1.0, logit_mean: float = 0.0, logit_std: float = 1.0,
                sigma_range: Sequence[float] = (0.0, 1.0)) -> torch.Tensor:
    """``n`` training noise levels ``(n,)`` fp32 in ``sigma_range`` (module doc): ``u`` uniform or
    logit-normal ``sigmoid(N(logit_mean, logit_std))``, shifted by ``shift``, conditioned on
    ``lo <= s <= hi`` by inverse-CDF sampling (one ``torch.rand`` draw of ``n`` from ``generator``).

    Raises ``ValueError`` on an unknown ``sampling``, ``shift`` or ``logit_std`` not > 0, or a
    ``sigma_range`` outside ``0 <= lo < hi <= 1``.
    """
    _check_draw(sampling, shift, logit_std, sigma_range)
    ends = sigma_cdf(torch.tensor([float(v) for v in sigma_range]), sampling, shift, logit_mean, logit_std)
    q = ends[0] + (ends[1] - ends[0]) * torch.rand(n, generator=generator, dtype=torch.float64)
    return sigma_icdf(q, sampling, shift, logit_mean, logit_std).float()


def scheduler_config(folder: Union[str, Path]) -> dict:
    """The ``scheduler_config.json`` dict of a pipeline folder's ``scheduler/`` (or of a scheduler
    folder). Raises ``FileNotFoundError`` naming the paths tried, ``ValueError`` naming the file
    when it is not valid JSON or not a JSON object."""
    folder = Path(folder)
    for path in (folder / "scheduler" / "scheduler_config.json", folder / "scheduler_config.json"):
        if path.is_file():
            from vitp.models.wan_config import read_json_object

            return read_json_object(path, "scheduler options", "copy the pipeline's scheduler/ folder again")
    raise FileNotFoundError(f"no scheduler/scheduler_config.json or scheduler_config.json in {folder}; give a local "
                            "diffusers Wan pipeline folder (model_index.json, scheduler/, transformer/)")


def config_shift(config: dict) -> float:
    """The flow shift of a scheduler config, by its ``_class_name``: ``shift`` of a
    ``FlowMatchEulerDiscreteScheduler``, else ``flow_shift`` (``UniPCMultistepScheduler`` with
    ``use_flow_sigmas``). When the key is absent the shift is 1.0 (no shift), the default
    diffusers' schedulers and so ``WanPipeline`` use, and a warning is logged, since Wan's
    published folders set it (3.0 at 480p, 5.0 at 720p in Wan's examples; 12.0 for Wan 2.2 A14B).
    Raises ``ValueError`` for a config without flow sigmas (not a flow-matching schedule) or a
    shift that is not a number."""
    euler = config.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
    if not euler and not config.get("use_flow_sigmas", False):
        raise ValueError(f"{config.get('_class_name')} with use_flow_sigmas=false is not a flow-matching "
                         "schedule; Wan's scheduler has use_flow_sigmas=true and prediction_type='flow_prediction'")
    key = "shift" if euler else "flow_shift"
    if key not in config:
        log.warning("scheduler config (%s) has no %s: using shift 1.0 (no shift), as diffusers does; pass "
                    "flow_shift= / shift= to set it", config.get("_class_name"), key)
        return 1.0
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"scheduler config {key}={value!r} must be a number (Wan: 3.0 or 5.0)")
    return float(value)


def make_wan_pair(x: torch.Tensor, eps: torch.Tensor, s: torch.Tensor, *cond: torch.Tensor
                  ) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """The pipeline pair: inputs ``(x_t, 1000 s, *cond)`` of the first stage (:func:`noisy_input`;
    ``cond`` the caption embeddings ``(B, 512, text_dim)``) and targets ``(x, eps, s)`` of
    :class:`WanFlowLoss` (``s`` third, where the trainer's records read the level). Raises
    ``ValueError`` as :func:`noisy_input` (mismatched shapes, ``s`` outside [0, 1])."""
    x_t, timestep = noisy_input(x, eps, s)
    return (x_t, timestep, *cond), (x, eps, s)


class WanFlowLoss(nn.Module):
    """Wan's velocity loss. ``forward(v_pred, (x, eps, s)) -> scalar`` (batch mean of :func:`flow_loss`).

    The interface of :class:`vitp.objectives.flow.FlowMatchingLoss` (``per_sample``, ``records``,
    ``pop_records``, targets with the noise level third) so the trainer can use either; ``records``
    hold ``s`` in [0, 1] (1 = noise), not the x-prediction objective's ``t`` (1 = data).

    Parameters
    ----------
    shift : flow shift of the training draw and of the ``"bell"`` weight (:meth:`from_pipeline`
        reads the scheduler's ``flow_shift``)
    sampling, logit_mean, logit_std, sigma_range : the draw (:func:`draw_sigmas`)
    weighting : ``"none"`` or ``"bell"`` (:func:`loss_weights`)

    Raises ``ValueError`` for options :func:`draw_sigmas` or :func:`loss_weights` refuse.
    """

    def __init__(self, shift: float, sampling: str = "uniform", weighting: str = "none", logit_mean: float = 0.0,
                 logit_std: float = 1.0, sigma_range: Sequence[float] = (0.0, 1.0)):
        super().__init__()
        _check_draw(sampling, shift, logit_std, sigma_range)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"objective weighting={weighting!r} is not supported; use one of {WEIGHTINGS}")
        self.shift, self.sampling, self.weighting = float(shift), sampling, weighting
        self.logit_mean, self.logit_std = float(logit_mean), float(logit_std)
        self.sigma_range = tuple(float(v) for v in sigma_range)
        self.records: list = []

    @classmethod
    def from_pipeline(cls, folder: Union[str, Path], shift: Optional[float] = None, **options) -> "WanFlowLoss":
        """The loss with ``shift`` (default: the ``flow_shift`` of ``folder``'s scheduler,
        :func:`config_shift`); errors as :func:`scheduler_config` and the constructor."""
        return cls(config_shift(scheduler_config(folder)) if shift is None else shift, **options)

    def draw_sigmas(self, n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``(n,)`` fp32 noise levels of this objective's draw (:func:`draw_sigmas`)."""
        return draw_sigmas(n, generator, sampling=self.sampling, shift=self.shift, logit_mean=self.logit_mean,
                           logit_std=self.logit_std, sigma_range=self.sigma_range)

    def draw_sample_noise(self, shape: Sequence[int], seed: int) -> Tuple[torch.Tensor, float]:
        """``(eps (shape), s)`` of one sample from its own generator seeded with ``seed`` (as
        :func:`vitp.objectives.flow.draw_sample_noise`: the same at any batch split)."""
        g = torch.Generator().manual_seed(seed)
        s = self.draw_sigmas(1, g).item()
        return torch.randn(tuple(shape), generator=g), s

    def per_sample(self, pred: torch.Tensor, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``(B,)`` (:func:`flow_loss`) of ``pred`` against targets ``(x, eps, s)``."""
        x, eps, s = targets
        return flow_loss(pred, x, eps, s, self.weighting, self.shift)

    def forward(self, pred: torch.Tensor, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        per = self.per_sample(pred, targets)
        self.records.append((targets[2].detach().float().cpu(), per.detach().cpu()))
        return per.mean()

    def pop_records(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(s (M,), loss (M,))`` of all samples since the last call."""
        if not self.records:
            return torch.zeros(0), torch.zeros(0)
        s, loss = (torch.cat(v) for v in zip(*self.records))
        self.records.clear()
        return s, loss
