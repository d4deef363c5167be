"""Wan sampling with diffusers' own schedulers, the denoising loop of diffusers' ``WanPipeline``.

The loop of :func:`sample_wan` is the one of ``WanPipeline.__call__``
(``diffusers/pipelines/wan/pipeline_wan.py``, text-to-video, diffusers 0.42): the scheduler's
``set_timesteps`` and ``set_begin_index(0)``, then per timestep ``t`` a conditional and (with
``guidance_scale > 1``) an unconditional pass of the denoiser on the latents cast to the
denoiser's dtype, timestep ``t.expand(B)``, classifier-free guidance ``uncond + w (cond -
uncond)`` (Ho & Salimans 2022, arXiv 2207.12598) and ``scheduler.step`` on fp32 latents. Wan 2.2
A14B's two experts (Wan Team 2025, arXiv 2503.20314; diffusers' ``boundary_ratio``): the
high-noise ``denoiser`` for ``t >= boundary_ratio * num_train_timesteps`` with ``guidance_scale``,
the low-noise ``denoiser_2`` below with ``guidance_scale_2``. Wan 2.2 TI2V-5B
(``expand_timesteps``): the timestep is given per token, ``(B, N)``, built as the pipeline builds it
(:func:`token_timesteps`; text-to-video: ``t`` on every token). No scheduler math is copied: the
step is the diffusers object's (``UniPCMultistepScheduler`` with flow sigmas, Wan's default, or
``FlowMatchEulerDiscreteScheduler``), built from a pipeline folder by :func:`load_scheduler`.

Caption embeddings are passed as ``WanPipeline`` builds them from umT5 (:func:`pad_prompt_embeds`:
the prompt's tokens, then zeros up to ``max_sequence_length = 512``). :func:`decode_latents` turns
latents into frames as the pipeline does (``latents_mean``/``latents_std``, VAE, video processor).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from .samplers import _placement
from .wan_flow import config_shift, scheduler_config

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SCHEDULERS = {"unipc": "UniPCMultistepScheduler", "euler": "FlowMatchEulerDiscreteScheduler"}
MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default max_sequence_length


def pad_prompt_embeds(embeds: torch.Tensor, lengths: torch.Tensor,
                      max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> torch.Tensor:
    """Caption embeddings as ``WanPipeline._get_t5_prompt_embeds`` returns them after the encoder:
    each sample's first ``length`` tokens, then zeros up to ``max_sequence_length``.

    Parameters
    ----------
    embeds : (B, L, D) encoder outputs (any values past each length are dropped)
    lengths : (B,) token counts, or a (B, L) attention mask (counted as ``mask > 0``, as the pipeline)
    max_sequence_length : tokens of the result; longer captions are cut to it (the tokenizer's
        ``truncation=True``)

    Returns (B, max_sequence_length, D) in ``embeds``' dtype and device. Raises ``ValueError`` when
    ``lengths`` is not (B,) or (B, L), or a length is negative or above L.
    """
    B, L, D = embeds.shape
    if lengths.dim() == 2 and tuple(lengths.shape) == (B, L):
        lengths = lengths.gt(0).sum(dim=1)
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths {tuple(lengths.shape)} must be (B,)=({B},) counts or a (B, L)=({B}, {L}) mask")
    if (lengths < 0).any() or (lengths > L).any():
        raise ValueError(f"caption lengths {lengths.tolist()} must lie in [0, {L}] (the embeddings' tokens)")
    out = embeds.new_zeros(B, max_sequence_length, D)
    for i, n in enumerate(lengths.clamp(max=max_sequence_length).tolist()):
        out[i, :n] = embeds[i, :n]
    return out


def load_scheduler(folder: Union[str, Path], kind: Optional[str] = None, flow_shift: Optional[float] = None) -> Any:
    """A diffusers scheduler object from a pipeline folder's ``scheduler/`` (or a scheduler folder).

    ``kind``: ``"unipc"`` (``UniPCMultistepScheduler``, flow prediction with flow sigmas, as Wan's
    folders save it), ``"euler"`` (``FlowMatchEulerDiscreteScheduler``), or None for the saved
    class; a different class is built ``from_config`` of the saved one's options it shares (so
    no option of the other class lingers in its config). ``flow_shift``: the
    schedule's shift (UniPC ``flow_shift``, Euler ``shift``), default the saved one
    (:func:`vitp.objectives.wan_flow.config_shift`: 1.0, with a logged warning, when the saved
    config has none).

    Raises ``FileNotFoundError`` without a scheduler config, ``ValueError`` for a config file that
    is not a JSON object (naming it), another ``kind``, a saved class that is neither, or a UniPC
    config without flow sigmas.
    """
    import diffusers

    config = scheduler_config(folder)
    saved = config.get("_class_name")
    if saved not in SCHEDULERS.values():
        raise ValueError(f"{folder}: scheduler {saved!r} is not one of Wan's flow schedulers "
                         f"{sorted(SCHEDULERS.values())}")
    if kind is not None and kind not in SCHEDULERS:
        raise ValueError(f"scheduler kind={kind!r} is not supported; use one of {sorted(SCHEDULERS)} or None")
    shift = config_shift(config) if flow_shift is None else float(flow_shift)
    cls = getattr(diffusers, SCHEDULERS[kind] if kind is not None else saved)
    own = {k: v for k, v in config.items() if k in inspect.signature(cls.__init__).parameters}  # no stale keys
    if cls is diffusers.UniPCMultistepScheduler:
        return cls.from_config(own, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    return cls.from_config(own, shift=shift)


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance as ``WanPipeline``: ``uncond + scale * (cond - uncond)``, in the
    predictions' dtype; shapes ``(B, C, T, H, W)``."""
    return uncond + scale * (cond - uncond)


def token_timesteps(t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The per-token timesteps ``(B, N)`` fp32 that ``WanPipeline`` gives the transformer with
    ``expand_timesteps`` (Wan 2.2 TI2V-5B, text-to-video): ``t`` at every token of the ``(T, H / 2,
    W / 2)`` grid of ``latents (B, C, T, H, W)`` (the pipeline's ``mask[0][0][:, ::2, ::2] * t``
    with a mask of ones: no image-conditioned first frame), flattened as the tokens."""
    mask = torch.ones(latents.shape[2:], dtype=torch.float32, device=latents.device)
    return (mask[:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)


def _check(latents, prompt_embeds, negative_prompt_embeds, guidance_scale, denoiser_2, boundary_ratio,
           guidance_scale_2) -> None:
    if latents.dim() != 5 or prompt_embeds.dim() != 3 or prompt_embeds.shape[0] != latents.shape[0]:
        raise ValueError(f"latents {tuple(latents.shape)} must be (B, C, T, H, W) and prompt_embeds "
                         f"{tuple(prompt_embeds.shape)} (B, L, text_dim) with the same B")
    if guidance_scale > 1.0 and negative_prompt_embeds is None:
        raise ValueError("guidance_scale > 1 needs negative_prompt_embeds of the prompt_embeds' shape (the encoded "
                         "negative prompt, WanPipeline's default is the empty prompt ''); or guidance_scale=1.0")
    if guidance_scale > 1.0 and negative_prompt_embeds.shape != prompt_embeds.shape:
        raise ValueError(f"negative_prompt_embeds {tuple(negative_prompt_embeds.shape)} must have the shape of "
                         f"prompt_embeds {tuple(prompt_embeds.shape)}: encode the negative prompt with the same "
                         "encoder and pad_prompt_embeds to the same length")
    if (boundary_ratio is None) != (denoiser_2 is None):
        raise ValueError("boundary_ratio and denoiser_2 (the low-noise expert) go together (Wan 2.2 A14B)")
    if boundary_ratio is not None and not 0.0 < boundary_ratio < 1.0:
        raise ValueError(f"boundary_ratio={boundary_ratio} must lie in (0, 1): the fraction of num_train_timesteps "
                         "where the low-noise expert takes over (Wan 2.2 A14B T2V: 0.875)")
    if boundary_ratio is None and guidance_scale_2 is not None:
        raise ValueError("guidance_scale_2 is only supported with boundary_ratio (as WanPipeline)")


def _check_run(scheduler, num_inference_steps, latents, denoisers) -> None:
    missing = [m for m in ("set_timesteps", "set_begin_index", "step") if not callable(getattr(scheduler, m, None))]
    if missing or not hasattr(scheduler, "config"):
        raise TypeError(f"scheduler {type(scheduler).__name__} is not a diffusers scheduler (no "
                        f"{missing or ['config']}); build one with load_scheduler(folder)")
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
        raise ValueError(f"num_inference_steps={num_inference_steps!r} must be an integer >= 1")
    for model in denoisers:
        channels = getattr(getattr(model, "config", None), "in_channels", None)
        if isinstance(channels, int) and latents.shape[1] != channels:
            raise ValueError(f"latents {tuple(latents.shape)} have {latents.shape[1]} channels, the denoiser takes "
                             f"{channels}: give (B, {channels}, T, H, W) noise (the VAE's z_dim)")


@torch.no_grad()
def sample_wan(denoiser: Denoiser, scheduler: Any, latents: torch.Tensor, prompt_embeds: torch.Tensor,
               negative_prompt_embeds: Optional[torch.Tensor] = None, *, num_inference_steps: int = 50,
               guidance_scale: float = 5.0, denoiser_2: Optional[Denoiser] = None,
               boundary_ratio: Optional[float] = None, guidance_scale_2: Optional[float] = None,
               expand_timesteps: bool = False,
               on_step: Optional[Callable[[int, torch.Tensor], None]] = None) -> torch.Tensor:
    """Denoise ``latents`` from pure noise with ``WanPipeline``'s loop (module doc): returns the final
    latents ``(B, C, T, H, W)``, what ``WanPipeline(..., output_type="latent")`` returns (fp32; in
    the denoiser's dtype after ``FlowMatchEulerDiscreteScheduler``, whose step casts to it).

    Parameters
    ----------
    denoiser : ``(latents (B, C, T, H, W), timestep (B,) in [0, 1000], text (B, L, text_dim)) ->
        velocity (B, C, T, H, W)`` (:class:`vitp.models.wan.WanModel`); the timestep has the
        scheduler's dtype (int64 for UniPC, fp32 for Euler), as in the pipeline; its dtype (first
        parameter, or a ``.dtype`` attribute; fp32 otherwise) is the dtype of its inputs, as the
        pipeline's ``transformer.dtype``
    scheduler : a diffusers flow scheduler (:func:`load_scheduler`); its state is reset here
    latents : (B, C, T, H, W) initial noise (the pipeline's ``latents=``), moved to the denoiser's device
    prompt_embeds, negative_prompt_embeds : (B, 512, text_dim) :func:`pad_prompt_embeds` outputs
    guidance_scale : CFG weight; the unconditional pass runs when it is > 1 (as the pipeline, also
        in the low-noise stage)
    denoiser_2, boundary_ratio, guidance_scale_2 : Wan 2.2's low-noise expert, used for ``t <
        boundary_ratio * num_train_timesteps``, with ``guidance_scale_2`` (default ``guidance_scale``)
    expand_timesteps : the pipeline's option of Wan 2.2 TI2V-5B: the denoiser gets per-token
        timesteps ``(B, N)`` (:func:`token_timesteps`) instead of ``(B,)``
    on_step : called as ``on_step(i, t)`` after each step

    Raises ``ValueError`` on mismatched shapes (latents not ``(B, C, T, H, W)`` of the denoiser's
    ``config.in_channels`` channels, negative embeddings of another shape), guidance without
    negative embeddings, expert options given without each other, ``boundary_ratio`` outside
    (0, 1) or ``num_inference_steps`` below 1; ``TypeError`` for a ``scheduler`` that is not a
    diffusers scheduler (``set_timesteps``, ``set_begin_index``, ``step``, ``config``).
    """
    _check(latents, prompt_embeds, negative_prompt_embeds, guidance_scale, denoiser_2, boundary_ratio,
           guidance_scale_2)
    _check_run(scheduler, num_inference_steps, latents, [m for m in (denoiser, denoiser_2) if m is not None])
    device, dtype = _placement(denoiser)
    if boundary_ratio is not None and guidance_scale_2 is None:
        guidance_scale_2 = guidance_scale
    cond = prompt_embeds.to(device=device, dtype=dtype)
    uncond = negative_prompt_embeds.to(device=device, dtype=dtype) if guidance_scale > 1.0 else None
    scheduler.set_timesteps(num_inference_steps, device=device)
    scheduler.set_begin_index(0)  # as the pipeline: no index search per step
    boundary = None if boundary_ratio is None else boundary_ratio * scheduler.config.num_train_timesteps
    latents = latents.to(device=device, dtype=torch.float32)
    for i, t in enumerate(scheduler.timesteps):
        high = boundary is None or t >= boundary
        model, scale = (denoiser, guidance_scale) if high else (denoiser_2, guidance_scale_2)
        x_in = latents.to(dtype)
        timestep = token_timesteps(t, latents) if expand_timesteps else t.expand(latents.shape[0])
        pred = model(x_in, timestep, cond)
        if uncond is not None:
            pred = cfg_combine(pred, model(x_in, timestep, uncond), scale)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i, t)
    return latents


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor, output_type: str = "np") -> Any:
    """Frames of Wan latents ``(B, z_dim, T, H, W)`` as ``WanPipeline`` decodes them: cast to the VAE's
    dtype and device, ``latents * latents_std + latents_mean`` (the VAE config's per-channel
    statistics), ``vae.decode``, then diffusers' ``VideoProcessor.postprocess_video``.

    ``vae``: a diffusers ``AutoencoderKLWan``. Returns for ``output_type="np"`` a ``(B, F, H', W',
    3)`` float array in [0, 1] (``"pt"``: a ``(B, F, 3, H', W')`` tensor; ``"pil"``: lists of images).
    Raises ``ValueError`` when ``latents`` has another channel count than ``vae.config.z_dim``.
    """
    from diffusers.video_processor import VideoProcessor

    cfg = vae.config
    if latents.dim() != 5 or latents.shape[1] != cfg.z_dim:
        raise ValueError(f"latents {tuple(latents.shape)} must be (B, {cfg.z_dim}, T, H, W) for this VAE")
    p = next(vae.parameters())
    latents = latents.to(device=p.device, dtype=p.dtype)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # the pipeline's 1/std form, same rounding
    return VideoProcessor(vae_scale_factor=cfg.scale_factor_spatial).postprocess_video(video, output_type=output_type)
