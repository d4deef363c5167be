"""Samples from a trained generator with the run's sampler settings: fixed-seed class grids
(PNG, and GIFs for video), and batches with given labels for evaluation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig

from vitp.config import parse_resolution
from vitp.media import frame_strip, to_grid, write_video_samples
from vitp.objectives import sample
from .inference import Share
from .progress import check_stop, common_batches, phase
from vitp.utils import atomic_write


def class_grid_labels(num_classes: int, per_class: int, max_rows: int = 0) -> torch.Tensor:
    """``[c0]*per_class + [c1]*per_class + ...``: one grid row per class; with ``max_rows`` only
    that many classes, evenly spaced over ``[0, num_classes)``."""
    rows = num_classes if not max_rows or max_rows >= num_classes else max_rows
    classes = torch.linspace(0, num_classes - 1, rows).round().long()
    return classes.repeat_interleave(per_class)


def sample_noise(seed: int, indices: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``(len(indices), *shape)`` standard normal noise, sample ``i``'s from its own generator
    seeded by ``(seed, i)`` (:func:`vitp.objectives.sample_seed`): a sample is the same whichever
    rank or batch draws it."""
    from vitp.objectives import sample_seed

    return torch.stack([torch.randn(tuple(shape), generator=torch.Generator().manual_seed(sample_seed(seed, int(i))))
                        for i in indices]) if len(indices) else torch.empty((0, *shape))


def generate(gen: Any, cfg: DictConfig, labels: torch.Tensor, seed: int, conditioning: Any = None,
             share: Optional[Share] = None, gather: bool = True, purpose: str = "", first: int = 0
             ) -> Optional[torch.Tensor]:
    """Samples ``(B, C, T, H, W)`` for ``labels`` with the configured sampler, in batches of
    ``sampler.batch_size`` per replica, at the size ``model.image_size`` (an int, ``[H, W]`` or
    ``"HxW"``) and ``model.num_frames``; sample ``i`` starts from :func:`sample_noise` of
    ``(seed, first + i)`` (``first``: the index of ``labels[0]`` in a longer set drawn in parts).

    ``gen``: a :class:`vitp.models.Generator` or a :class:`vitp.eval.inference.StageDenoiser`.
    ``labels``: ``(B,)`` ids of ``conditioning`` (:mod:`vitp.data.text`: class labels by default,
    or caption / prompt ids of a text-conditional model); guidance's unconditional input is
    ``conditioning``'s ``null_id``. With ``share`` (:class:`vitp.eval.inference.Share`) each
    data-parallel replica samples its range of the labels and the samples are gathered: the
    result is on global rank 0, ``None`` elsewhere (collective); with ``gather=False`` each rank
    returns its replica's samples (no collective). ``purpose`` (e.g. ``"the sample grid"``) names
    what the samples are for in the phase line of the final evaluation (:mod:`vitp.eval.progress`)."""
    from vitp.data.text import ClassConditioning

    s, m = cfg.sampler, cfg.model
    share = share or Share()
    cond = conditioning if conditioning is not None else ClassConditioning(m.num_classes)
    null = cond(torch.tensor([cond.null_id]))
    shape = (m.in_channels, m.num_frames, *parse_resolution(m.image_size, "model.image_size"))
    mine = share.indices(len(labels))
    out = [torch.empty((0, *shape))]
    what = (f"sampling {len(labels)} samples{f' for {purpose}' if purpose else ''} ({s.method}, {s.steps} steps, cfg_scale {s.cfg_scale:g}"
            f"{f', over {share.size} replicas' if share.size > 1 else ''})")
    common = common_batches(len(labels), share.size, s.batch_size)  # a stop request is asked after their steps
    with phase(what, -(-len(mine) // s.batch_size) * s.steps, "sampling", "step", share.main) as bar:
        for b, i in enumerate(range(mine.start, mine.stop, s.batch_size)):
            idx = range(i, min(mine.stop, i + s.batch_size))

            def on_step(n: int = 1, _asked: bool = b < common) -> None:
                bar.update(n)
                check_stop(_asked)

            out.append(sample(gen, cond(labels[idx.start:idx.stop]), shape, null=null, steps=s.steps,
                              method=s.method, cfg_scale=s.cfg_scale, cfg_interval=tuple(s.cfg_interval),
                              noise_scale=cfg.objective.noise_scale, t_eps=cfg.objective.t_eps,
                              noise=sample_noise(seed, range(first + idx.start, first + idx.stop), shape), on_step=on_step).cpu())
    x = to_pixels(cfg, torch.cat(out), _device(gen))  # a latent run: each replica decodes its own samples
    return share.gather(x, len(labels)) if gather else x


def _device(gen: Any) -> torch.device:
    p = next(iter(gen.parameters()), None) if hasattr(gen, "parameters") else None
    return p.device if p is not None else getattr(gen, "device", torch.device("cpu"))


def to_pixels(cfg: DictConfig, x: torch.Tensor, device: Any = "cpu") -> torch.Tensor:
    """``x`` ``(B, C, T, H, W)`` as pixels: decoded through ``data.vae`` on ``device`` when the run
    trains on latents (``data.latent_channels > 0``; :class:`vitp.latents.vae.LocalVAE`, one sample
    at a time, tiled for video), else ``x`` itself (also synthetic latents without ``data.vae``:
    training refuses every other latent run without one, :func:`vitp.latents.config.check_decoder`)."""
    d = cfg.data
    if not d.get("latent_channels") or not d.get("vae") or not len(x):  # synthetic latents without a VAE: as they are
        return x
    from vitp.latents.vae import decoder

    return decoder(d.vae, device).decode(x)


def heldout_label_samples(gen: Any, cfg: DictConfig, y_ho: torch.Tensor, conditioning: Any = None,
                          share: Optional[Share] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(labels, samples)``: ``eval.num_samples`` (0 = as many as held-out items) samples with the
    held-out labels (or caption ids, with ``conditioning``; cycled), from the fixed seed
    ``eval.noise_seed + 1`` (:func:`generate`: ``None`` samples off rank 0 with ``share``)."""
    n = cfg.eval.num_samples or len(y_ho)
    labels = y_ho.repeat(n // len(y_ho) + 1)[:n]
    return labels, generate(gen, cfg, labels, seed=cfg.eval.noise_seed + 1, conditioning=conditioning, share=share,
                            purpose="the held-out labels (FD, accuracy)")


def grid_ids(cfg: DictConfig, conditioning: Any = None) -> torch.Tensor:
    """The conditioning ids of the sample grid, ``sampler.samples_per_class`` per row: classes
    (:func:`class_grid_labels`), or prompts ``1..n`` of a :class:`vitp.data.text.PromptConditioning`."""
    per = cfg.sampler.samples_per_class
    prompts = getattr(conditioning, "prompts", None)
    if prompts is not None:
        return torch.arange(1, len(prompts)).repeat_interleave(per)
    return class_grid_labels(cfg.model.num_classes, per, cfg.sampler.grid_classes)


def write_sample_grid(gen: Any, cfg: DictConfig, path: Path, conditioning: Any = None,
                      share: Optional[Share] = None) -> Optional[Dict[str, Any]]:
    """Write the fixed-seed class grid (one row per class) as PNG (first frames) at ``path``; for
    video (``num_frames > 1``) also one GIF per class and seed plus ``grid.gif`` in the folder
    ``path`` without its suffix (e.g. ``samples/step_0000500/``), at ``sampler.fps``. With a
    :class:`vitp.data.text.PromptConditioning` one row per prompt, captioned with it in the PNG.

    Returns ``{"grid": (3, H', W') in [0, 1], "strips": (rows, 3, H, T * W) in [0, 1] or None}``;
    the strips (each class row's first sample, frames side by side) are TensorBoard's view of the videos.
    With ``share`` the samples are split over the replicas (:func:`generate`) and rank 0 alone
    writes (``None`` elsewhere).
    """
    from torchvision.utils import save_image

    from vitp.media import caption_rows

    labels = grid_ids(cfg, conditioning)
    x = generate(gen, cfg, labels, cfg.sampler.seed, conditioning, share, purpose="the sample grid")
    if x is None:
        return None
    grid = to_grid(x, nrow=cfg.sampler.samples_per_class)
    prompts = getattr(conditioning, "prompts", None)
    if prompts is not None:
        grid = caption_rows(grid, prompts[1:])
    with atomic_write(path) as tmp:  # same suffix: save_image picks the format by it
        save_image(grid, str(tmp))
    strips = None
    if x.shape[2] > 1:
        write_video_samples(x, labels, path.parent, name=path.stem, fps=cfg.sampler.fps)
        strips = frame_strip(x[::cfg.sampler.samples_per_class], padding=1, min_tile=32)
    return {"grid": grid, "strips": strips}


def at_size(cfg: DictConfig, size: Sequence[int], frames: int) -> DictConfig:
    """A copy of ``cfg`` whose model samples ``(H, W) = size`` pixels and ``frames`` frames (the
    generator follows the input's shape, :func:`vitp.models.set_grid`)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg, {"model": {"image_size": [int(v) for v in size], "num_frames": int(frames)}})


def write_bucket_grids(gen: Any, cfg: DictConfig, buckets: Sequence[Any], folder: Path,
                       conditioning: Any = None, share: Optional[Share] = None) -> Dict[str, Any]:
    """One fixed-seed class grid per shape bucket: ``folder/grid_<name>.png`` (``name`` as
    :attr:`vitp.data.buckets.Bucket.name`, e.g. ``grid_6x10.png``, ``grid_32x32x8.png``; video
    GIFs in ``folder/grid_<name>/``), each tile ``H x W`` pixels of its bucket (upscaled as in
    :func:`vitp.media.to_grid`). Returns ``{name: write_sample_grid's result}`` (with ``share``:
    on rank 0; ``{}`` elsewhere)."""
    out = {b.name: write_sample_grid(gen, at_size(cfg, b.size, b.frames), folder / f"grid_{b.name}.png",
                                     conditioning, share) for b in buckets}
    return {k: v for k, v in out.items() if v is not None}
