"""Sample grids, the held-out loss and the evaluation of a Wan run (``model.family=wan``): in
``vitp-train`` at ``trainer.sample_every`` / ``trainer.eval_every`` and at the end (the EMA weights in
the training layout, :meth:`vitp.train.Trainer.ema_denoiser`), and in ``vitp-eval RUN``
(:func:`run_wan_eval`: the run's final ``RUN/diffusers`` folder, in one process or split over ranks).

Samples are drawn as ``WanPipeline.__call__`` draws them (diffusers' ``pipelines/wan/pipeline_wan.py``;
Wan Team 2025, arXiv 2503.20314): :func:`vitp.objectives.wan_sampling.sample_wan` with diffusers' own
scheduler of the pipeline's ``scheduler/`` folder (:func:`vitp.objectives.wan_sampling.load_scheduler`:
the saved class and ``flow_shift``), the prompts' embeddings zero-padded to 512 tokens, the empty
prompt as the negative prompt, ``guidance_scale = sampler.cfg_scale``. Sample ``i`` starts from
:func:`vitp.eval.sampling.sample_noise` of ``(seed, i)``, so a grid is the same in every layout, and
the end-of-run grid is what ``vitp-sample`` draws of the same prompts (both use ``sampler.seed``).
Latents are decoded through the pipeline's ``vae/`` (:func:`vitp.eval.wan_sample.decode_frames`)
when it has one; otherwise the grid previews latent channels 0-2 as RGB.

The held-out loss (:func:`wan_heldout_loss`) is Wan's flow-matching loss
(:func:`vitp.objectives.wan_flow.flow_loss`, the run's weighting and shift) at ``K = eval.t_grid``
fixed noise levels, the quantiles ``(k + 0.5) / K`` of the run's training draw (so their mean
estimates the expected training loss), with noise seeded by ``(eval.noise_seed, item, k)``: the
same in every layout and batch split. Captions are not dropped.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from vitp.utils import load_run_yaml

from .inference import Share
from .progress import check_stop, common_batches, phase

log = logging.getLogger("vitp")
LATENT_PREVIEW = "no vae/ in the pipeline: the grid shows latent channels 0-2 as RGB"


def sampling_pipeline(cfg: Any) -> Optional[Path]:
    """The pipeline folder of ``trainer.init_from`` whose ``scheduler/`` the samples use, or ``None``
    for a transformer folder without its pipeline (no sample grid then: :func:`vitp.models.wan_run.adopt_wan_model`
    warns at the config check)."""
    from vitp.models.wan_run import pipeline_folder, wan_source

    pipe = pipeline_folder(wan_source(cfg)[0])
    return pipe if pipe is not None and (pipe / "scheduler").is_dir() else None


@functools.lru_cache(maxsize=2)
def _vae(path: str, device: str = "cpu") -> Any:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(path, local_files_only=True).float().eval().to(device)


def to_frames(pipe: Optional[Path], latents: torch.Tensor, device: Any = "cpu", mid_level: bool = False
              ) -> torch.Tensor:
    """``(B, 3, F, H', W')`` in [-1, 1]: ``latents`` ``(B, C, T, H, W)`` decoded through ``pipe``'s
    ``vae/`` on ``device`` as ``WanPipeline`` decodes them (:func:`vitp.objectives.wan_sampling.decode_latents`,
    rounded to 8-bit levels ``L`` as its ``numpy_to_pil``: ``L / 127.5 - 1``, or with ``mid_level``
    ``(L + 0.5) / 127.5 - 1``, which guided-diffusion's truncating ``((x + 1) * 127.5).to(uint8)``
    (:func:`vitp.eval.fid.to_uint8`) turns back into ``L`` exactly, where ``L / 127.5 - 1`` loses a
    level on a quarter of them in float32), or without a VAE latent channels 0-2 (channel 0
    repeated when there are fewer than 3), clamped to [-1, 1]."""
    if pipe is not None and (pipe / "vae" / "config.json").is_file() and len(latents):
        from vitp.objectives.wan_sampling import decode_latents

        frames = torch.as_tensor(decode_latents(_vae(str(pipe / "vae"), str(device)), latents, output_type="np"))
        levels = (frames * 255).round().clamp(0, 255).permute(0, 4, 1, 2, 3).float()
        return (levels + (0.5 if mid_level else 0.0)) / 127.5 - 1
    x = latents.float()
    x = x[:, :3] if x.shape[1] >= 3 else x[:, :1].expand(-1, 3, -1, -1, -1)
    return x.clamp(-1, 1)


def padded_text(conditioning: Any, ids: torch.Tensor, text_len: int) -> torch.Tensor:
    """``(B, text_len, Dc)`` fp32 caption embeddings of ``ids`` as ``WanPipeline`` gives them: each
    caption's tokens, then zeros (:func:`vitp.objectives.wan_sampling.pad_prompt_embeds`)."""
    from vitp.objectives.wan_sampling import pad_prompt_embeds

    emb, mask = conditioning(ids.long())
    return pad_prompt_embeds(emb.float(), mask, int(text_len))


def wan_samples(gen: Any, scheduler: Any, cfg: Any, n: int, text_of: Callable[[range], torch.Tensor],
                negative: torch.Tensor, seed: int, share: Optional[Share] = None, gather: bool = True,
                purpose: str = "", first: int = 0) -> Optional[torch.Tensor]:
    """``(n, C, T, H, W)`` fp32 latents at the run's latent size: sample ``i`` denoised from
    :func:`vitp.eval.sampling.sample_noise` of ``(seed, first + i)`` (``first``: the index of sample
    0 in a longer set drawn in parts) with the caption embeddings
    ``text_of(range)`` ``(B, 512, Dc)`` against ``negative`` ``(1, 512, Dc)``, ``sampler.steps`` steps of
    ``scheduler``, CFG ``sampler.cfg_scale``, ``sampler.batch_size`` at a time. With ``share`` each
    replica samples its range; gathered on rank 0 (``None`` elsewhere; collective), or with
    ``gather=False`` each rank's own range."""
    from vitp.config import parse_resolution
    from vitp.objectives.wan_sampling import sample_wan

    from .sampling import sample_noise

    s, m, share = cfg.sampler, cfg.model, share or Share()
    shape = (int(m.in_channels), int(m.num_frames), *parse_resolution(m.image_size, "model.image_size"))
    mine = share.indices(n)
    out = [torch.empty((0, *shape))]
    what = f"sampling {n} Wan samples{f' for {purpose}' if purpose else ''} ({s.steps} steps, CFG {s.cfg_scale:g})"
    common = common_batches(n, share.size, s.batch_size)  # a stop request is asked after each of their steps
    with phase(what, -(-len(mine) // s.batch_size) * int(s.steps), "sampling", "step", share.main) as bar:
        for b, i in enumerate(range(mine.start, mine.stop, s.batch_size)):
            idx = range(i, min(mine.stop, i + s.batch_size))
            cond = text_of(idx)
            noise = sample_noise(seed, range(first + idx.start, first + idx.stop), shape)

            def on_step(_i: int, _t: Any, _asked: bool = b < common) -> None:  # within one forward of a stop
                bar.update(1)
                check_stop(_asked)

            out.append(sample_wan(gen, scheduler, noise, cond, negative.expand_as(cond), on_step=on_step,
                                  num_inference_steps=int(s.steps), guidance_scale=float(s.cfg_scale)).float().cpu())
    x = torch.cat(out)
    return share.gather(x, n) if gather else x


def write_wan_grid(gen: Any, cfg: Any, path: Path, prompts: Any, share: Optional[Share] = None
                   ) -> Optional[Dict[str, Any]]:
    """The fixed-seed sample grid of a Wan run: one row per prompt of ``prompts``
    (:class:`vitp.data.text.PromptConditioning`), ``sampler.samples_per_class`` columns, seed
    ``sampler.seed``; written as :func:`vitp.eval.sampling.write_sample_grid` writes the generator's
    (``path`` PNG of first frames captioned with the prompts; video: GIFs and ``grid.gif`` in
    ``path`` without its suffix) plus ``latents.safetensors`` there (``latents`` (B, C, T, H, W)).
    Returns ``{"grid", "strips"}`` on rank 0 (``None`` elsewhere, and everywhere for a transformer
    folder without its pipeline's ``scheduler/``). Collective with ``share``."""
    from torchvision.utils import save_image

    from vitp.media import caption_rows, frame_strip, to_grid, write_video_samples
    from vitp.objectives.wan_sampling import load_scheduler
    from vitp.utils import atomic_write, save_safetensors

    from .sampling import grid_ids

    pipe = sampling_pipeline(cfg)
    if pipe is None:
        return None
    ids = grid_ids(cfg, prompts)
    embeds = padded_text(prompts, torch.arange(len(prompts.prompts)), cfg.model.text_len)  # row 0: ""
    lat = wan_samples(gen, load_scheduler(pipe), cfg, len(ids), lambda idx: embeds[ids[idx.start:idx.stop]],
                      embeds[:1], int(cfg.sampler.seed), share, purpose="the sample grid")
    if lat is None:
        return None
    x = to_frames(pipe, lat)
    per = cfg.sampler.samples_per_class
    grid = caption_rows(to_grid(x, nrow=per), prompts.prompts[1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        save_image(grid, str(tmp))
    folder = path.with_suffix("")
    strips = None
    if x.shape[2] > 1:
        write_video_samples(x, ids, path.parent, name=path.stem, fps=cfg.sampler.fps)
        strips = frame_strip(x[::per], padding=1, min_tile=32)
    folder.mkdir(exist_ok=True)
    with atomic_write(folder / "latents.safetensors") as tmp:
        save_safetensors({"latents": lat.contiguous()}, tmp, metadata={"prompts": json.dumps(prompts.prompts[1:])})
    return {"grid": grid, "strips": strips}


def heldout_sigmas(loss: Any, K: int) -> torch.Tensor:
    """``(K,)`` float64 noise levels: the quantiles ``(k + 0.5) / K`` of ``loss``'s training draw
    (:func:`vitp.objectives.wan_flow.sigma_icdf`: sampling, shift, logit parameters, within
    ``sigma_range``)."""
    from vitp.objectives.wan_flow import sigma_cdf, sigma_icdf

    opts = dict(sampling=loss.sampling, shift=loss.shift, logit_mean=loss.logit_mean, logit_std=loss.logit_std)
    lo, hi = sigma_cdf(torch.tensor(loss.sigma_range, dtype=torch.float64), **opts)
    q = lo + (hi - lo) * (torch.arange(K, dtype=torch.float64) + 0.5) / K
    return sigma_icdf(q, **opts)


def heldout_noise(seed: int, indices: range, k: int, shape: Tuple[int, ...]) -> torch.Tensor:
    """``(len(indices), *shape)`` noise of held-out items ``indices`` at level ``k``, item ``i``'s
    from its own generator seeded by ``(seed, i, k)`` (:func:`vitp.objectives.sample_seed`)."""
    from vitp.objectives import sample_seed

    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(sample_seed(seed, i, k)))
                        for i in indices])


@torch.no_grad()
def wan_heldout_loss(gen: Any, cfg: Any, dataset: Any, conditioning: Any, loss: Any,
                     share: Optional[Share] = None, batch_size: Optional[int] = None) -> Dict[str, Any]:
    """Wan's flow-matching loss of ``gen`` on the held-out items (module doc): ``{"heldout_loss": the
    mean over items and levels, "heldout_loss_per_sigma": {"<s>": mean at level s}}`` (``s`` the
    noise fraction, 1 = noise). ``gen``: ``(x_t (B, C, T, H, W), timestep (B,) in [0, 1000], text
    (B, 512, Dc)) -> velocity`` (a :class:`vitp.models.wan.WanModel` or a
    :class:`vitp.eval.inference.StageDenoiser`); ``conditioning`` maps caption ids to embeddings;
    ``loss``: the run's :class:`vitp.objectives.wan_flow.WanFlowLoss`. Items go ``batch_size`` at a
    time (default :func:`vitp.eval.metrics.eval_batch_size`); with ``share`` each replica takes its
    range and the per-level sums (float64) are added over the replicas (collective, the result on
    every rank)."""
    from vitp.objectives.samplers import _placement
    from vitp.objectives.wan_flow import flow_loss, noisy_input

    from .metrics import eval_batch_size

    share = share or Share()
    sigmas = heldout_sigmas(loss, int(cfg.eval.t_grid))
    device, dtype = _placement(gen)
    batch_size = batch_size or eval_batch_size(cfg)
    per = torch.zeros(len(sigmas), dtype=torch.float64)
    n, mine = len(dataset), share.indices(len(dataset))
    what = f"Wan held-out loss of {n} items at {len(sigmas)} noise levels"
    common = common_batches(n, share.size, batch_size)  # a stop request is asked after each of their forwards
    with phase(what, -(-len(mine) // batch_size) * len(sigmas), "held-out loss", "forward", share.main) as bar:
        for b, start in enumerate(range(mine.start, mine.stop, batch_size)):
            idx = range(start, min(mine.stop, start + batch_size))
            items = [dataset[(i, None)] for i in idx]
            x = torch.stack([it[0] for it in items]).float()
            text = padded_text(conditioning, torch.tensor([int(it[1]) for it in items]), cfg.model.text_len)
            for k, s in enumerate(sigmas.tolist()):
                eps = heldout_noise(int(cfg.eval.noise_seed), idx, k, tuple(x.shape[1:]))
                sb = torch.full((len(idx),), s, dtype=torch.float32)
                x_t, timestep = noisy_input(x, eps, sb)
                pred = gen(x_t.to(device, dtype), timestep.to(device), text.to(device, dtype)).float().cpu()
                per[k] += flow_loss(pred, x, eps, sb, loss.weighting, loss.shift).double().sum()
                bar.update(1)
                check_stop(b < common)
    per = share.sum(per) / max(n, 1)
    return {"heldout_loss": per.mean().item(),
            "heldout_loss_per_sigma": {f"{s:.3f}": v for s, v in zip(sigmas.tolist(), per.tolist())}}


def wan_video_metrics(gen: Any, cfg: Any, heldout_ds: Any, conditioning: Any,
                      share: Optional[Share] = None) -> Dict[str, Any]:
    """:func:`vitp.eval.temporal.temporal_ratio` of ``eval.num_samples`` samples (0: one per
    held-out clip; the held-out captions, cycled; seed ``eval.noise_seed + 1``) against the real
    held-out clips, both decoded through the pipeline's VAE (:func:`to_frames`; without one both
    in latent space, channels 0-2), with ``"temporal_space"`` saying which and ``"sampler"`` the
    scheduler, steps, CFG and seed. Each replica samples, decodes and sums its own range; only
    the sums are added (collective, the result on every rank). ``{}`` without the pipeline's
    ``scheduler/``."""
    from vitp.objectives.wan_sampling import load_scheduler

    from .metrics import item_ids
    from .temporal import temporal_ratio, temporal_sums

    pipe = sampling_pipeline(cfg)
    if pipe is None:
        return {}
    share = share or Share()
    ids = item_ids(heldout_ds)
    n = int(cfg.eval.num_samples) or len(ids)
    labels = ids.repeat(n // len(ids) + 1)[:n]
    negative = padded_text(conditioning, torch.tensor([conditioning.null_id]), cfg.model.text_len)
    scheduler = load_scheduler(pipe)
    lat = wan_samples(gen, scheduler, cfg, n,
                      lambda idx: padded_text(conditioning, labels[idx.start:idx.stop], cfg.model.text_len),
                      negative, int(cfg.eval.noise_seed) + 1, share, gather=False, purpose="the temporal statistics")
    gen_sums = temporal_sums(to_frames(pipe, lat))
    real_sums = torch.zeros(2, dtype=torch.float64)
    for i in share.indices(len(heldout_ds)):
        real_sums += temporal_sums(to_frames(pipe, heldout_ds[(i, None)][0][None].float()))
    sums = share.sum(torch.cat([gen_sums, real_sums]))
    sc, s = dict(scheduler.config), cfg.sampler
    return {**temporal_ratio(sums[:2], sums[2:]), "num_samples": n,
            "temporal_space": "pixels (vae/)" if (pipe / "vae" / "config.json").is_file() else "latents",
            "sampler": {"scheduler": type(scheduler).__name__, "flow_shift": sc.get("flow_shift", sc.get("shift")),
                        "steps": int(s.steps), "cfg_scale": float(s.cfg_scale), "seed": int(cfg.eval.noise_seed) + 1}}


def check_wan_quality(cfg: Any) -> Optional[Path]:
    """Before any sample is drawn: the pipeline folder whose ``scheduler/`` samples and whose
    ``vae/`` decodes, ``None`` without ``eval.fid.num`` / ``eval.fvd.num``
    (:func:`vitp.models.wan_run.quality_pipeline` of ``trainer.init_from``, whose errors it raises)."""
    from vitp.models.wan_run import quality_pipeline, wan_source

    if not (cfg.eval.fid.num or cfg.eval.fvd.num):
        return None
    return quality_pipeline(cfg, wan_source(cfg)[0])


@functools.lru_cache(maxsize=4)
def _vae_digest(folder: str, stamp: Tuple) -> str:
    import hashlib

    from .fid import file_digest

    h = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    for p in sorted(Path(folder).glob("*.safetensors")):
        h.update(file_digest(p).encode())
    return h.hexdigest()


def vae_digest(pipe: Path) -> str:
    """sha256 of the pipeline's ``vae/`` (its config and weight files; cached while none changes):
    kept with the cached real statistics, which are the VAE's decodings of the real latents."""
    folder = (pipe / "vae").resolve()
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())
    return _vae_digest(str(folder), stamp)


def wan_quality_metrics(gen: Any, cfg: Any, train_ds: Any, heldout_ds: Any, run_dir: Path, npz: Path, clips: Path,
                        conditioning: Any, share: Optional[Share] = None) -> Dict[str, Any]:
    """The field's quality numbers of a Wan run (:func:`vitp.eval.metrics.quality_metrics` for the
    generator): FID of ``eval.fid.num`` samples written to ``npz`` (first frames of a video run) and,
    with ``eval.clip.model``, their CLIP score against their captions; for a video run with
    ``eval.fvd.num``, FVD of that many clips written to ``clips``. Samples are drawn as
    ``WanPipeline`` draws them (:func:`wan_samples`: the held-out captions cycled, the empty caption
    as the negative prompt, sample ``i`` from the noise of ``(eval.fid.seed, i)``, resp.
    ``eval.fvd.seed``) and decoded through the pipeline's ``vae/`` to 8-bit frames (:func:`to_frames`),
    the real held-out (or training) latents too; then :func:`vitp.eval.fid.fid_metrics` /
    :func:`vitp.eval.fvd.fvd_metrics` as for the generator (resumable blocks, cached real sums keyed
    by the data, the feature network and the VAE; only sums cross ranks). Rank 0's results (``{}``
    elsewhere). Raises :func:`check_wan_quality`'s errors, and each network's before its samples are
    drawn (the files are checked at launch: :func:`vitp.eval.metrics.check_quality_inputs`). Collective."""
    from vitp.objectives.samplers import _placement
    from vitp.objectives.wan_sampling import load_scheduler

    from .clip_score import check_clip, clip_metrics
    from .fid import fid_metrics
    from .fvd import fvd_metrics
    from .metrics import item_ids

    share = share or Share()
    pipe = check_wan_quality(cfg)
    if pipe is None:
        return {}
    fid, fvd = cfg.eval.fid.num, cfg.eval.fvd.num and int(cfg.model.num_frames) > 1
    clip = check_clip(cfg, conditioning) if fid else None  # a caption run's (the files: checked at launch)
    device = _placement(gen)[0]
    scheduler, text_len = load_scheduler(pipe), int(cfg.model.text_len)
    negative = padded_text(conditioning, torch.tensor([conditioning.null_id]), text_len)

    def draw(labels: torch.Tensor, first: int, seed: int, purpose: str) -> torch.Tensor:
        lat = wan_samples(gen, scheduler, cfg, len(labels),
                          lambda idx: padded_text(conditioning, labels[idx.start:idx.stop], text_len), negative, seed,
                          share, gather=False, purpose=purpose, first=first)
        # only the ranks that gather a replica's samples decode them (vitp.eval.inference.Share.gather)
        return decode(lat if share.group is None or share.gathers else lat[:0])

    def decode(lat: torch.Tensor) -> torch.Tensor:  # one clip at a time: a 480p clip's decode takes GBs
        if len(lat):
            return torch.cat([to_frames(pipe, lat[i:i + 1], device, mid_level=True).cpu() for i in range(len(lat))])
        c, (t, h, w) = _vae(str(pipe / "vae"), str(device)).config, lat.shape[2:]
        s = int(c.scale_factor_spatial)
        return torch.empty((0, 3, (t - 1) * int(c.scale_factor_temporal) + 1, h * s, w * s))

    decoder, ids = vae_digest(pipe), item_ids(heldout_ds) if len(heldout_ds) else None
    res: Dict[str, Any] = {}
    if fid:
        res.update(fid_metrics(gen, cfg, train_ds, heldout_ds, run_dir, npz, conditioning, share, ids, draw, decode,
                               decoder))
        if clip is not None:
            res.update(clip_metrics(cfg, npz, conditioning, share, device))
    if fvd:
        res.update(fvd_metrics(gen, cfg, train_ds, heldout_ds, run_dir, clips, conditioning, share, ids, draw, decode,
                               decoder))
    return res


def wan_evaluate(gen: Any, cfg: Any, train_ds: Any, heldout_ds: Any, run_dir: Path, *, full: bool = True,
                 step: Optional[int] = None, logger: Any = None, buckets: Any = None, out: Optional[Path] = None,
                 conditioning: Any = None, share: Optional[Share] = None, loss: Any = None,
                 head: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """:func:`vitp.eval.metrics.evaluate` for a Wan run: the held-out loss (:func:`wan_heldout_loss`,
    ``loss`` default the run's :func:`vitp.models.wan_run.wan_loss`) and, when ``full`` and the
    run is video (``model.num_frames > 1`` latent frames), :func:`wan_video_metrics`, and with
    ``eval.fid.num`` / ``eval.fvd.num`` FID, CLIP score and FVD (:func:`wan_quality_metrics`, samples
    in ``out`` with the suffixes ``.npz`` / ``.fvd.npz``). With ``full``
    the results go to ``out`` (default ``run_dir/eval.json``); with ``logger`` and ``step`` the
    floats go to TensorBoard as ``eval/<key>``. Rank 0 returns (and writes) everything, the other
    ranks the held-out loss. ``buckets`` must be empty (Wan trains one shape); ``head`` fields lead
    the results (``vitp-eval --weights``: the folder, and ``step`` null when the folder records none)."""
    from vitp.models.wan_run import wan_loss, wan_source

    if buckets:
        raise ValueError("data.buckets with model.family=wan: Wan is evaluated at one latent shape")
    share = share or Share()
    loss = loss if loss is not None else wan_loss(cfg, wan_source(cfg)[0])
    res: Dict[str, Any] = {**(head or {}), **({"step": step} if step is not None else {})}
    if len(heldout_ds):
        res.update(wan_heldout_loss(gen, cfg, heldout_ds, conditioning, loss, share))
    if full and int(cfg.model.num_frames) > 1 and len(heldout_ds):
        res.update(wan_video_metrics(gen, cfg, heldout_ds, conditioning, share))
    if full and (cfg.eval.fid.num or cfg.eval.fvd.num):
        base = Path(out) if out is not None else Path(run_dir) / "eval.json"
        res.update(wan_quality_metrics(gen, cfg, train_ds, heldout_ds, run_dir, base.with_suffix(".npz"),
                                       base.with_suffix(".fvd.npz"), conditioning, share))
    from .metrics import report

    return report(res, share, logger, step, full, run_dir, out)


# ----------------------------------------------------------------------------- vitp-eval RUN
def _check_same_model(cfg: Any, weights: str, run_dir: Path) -> None:
    """Raises ``ValueError`` when the folder ``trainer.init_from`` (``--weights``) holds a Wan model
    of other sizes than the run's recorded ``cfg.model`` (its scores would be filed as the run's)."""
    from vitp.models.wan_run import wan_source

    _, c = wan_source(cfg)
    m = cfg.model
    diffs = [f"{name} {theirs} vs the run's {ours}" for name, theirs, ours in (
        ("num_layers", c.num_layers, m.depth), ("num_attention_heads", c.num_attention_heads, m.num_heads),
        ("width", c.width, m.width), ("in_channels", c.in_channels, m.in_channels), ("text_dim", c.text_dim, m.text_dim))
        if int(theirs) != int(ours)]
    if diffs:
        raise ValueError(f"--weights {weights} holds a Wan model of other sizes than this run's ({', '.join(diffs)}); "
                         f"vitp-eval {run_dir} scores weights of the run's model on its data: give its base folder "
                         f"or an export of it (vitp-export {run_dir} --format diffusers -o OUT)")


def load_wan_for_eval(run_dir: Path, weights: Optional[str], overrides: List[str], sharded: bool
                      ) -> Tuple[Any, Any, Optional[Share], Any, Any, Any]:
    """``(cfg, denoiser, share, train_ds, heldout_ds, conditioning)`` of a finished Wan run for
    ``vitp-eval``: its config with ``overrides`` (schema-checked, then checked as ``vitp-train``
    checks a Wan run), the weights of the diffusers folder ``weights`` (default ``RUN/diffusers``,
    the run's final EMA weights; a LoRA run's: its base ``trainer.init_from`` with its final
    adapters ``RUN/lora``; a relative path is taken inside the run), its caption store and
    data split. With ``sharded`` (under a launcher; collective) this rank's stage in the layout of
    :func:`vitp.eval.launch.choose_layout` (replicas of the whole model when one fits a device,
    unless ``overrides`` name a layout key), reading only its slices (:func:`vitp.eval.wan_sample.build_wan_sharded`), else the
    whole model in one process.

    Raises ``FileNotFoundError`` when the folder or adapters are missing (an unfinished run: naming
    ``vitp-export --format diffusers``), ``ValueError`` when ``weights`` is a file, for bad
    overrides, a LoRA of another base and layouts the world cannot run."""
    from vitp.cli.overrides import apply_overrides, typed_config
    from vitp.data import build_datasets
    from vitp.data.text import conditioned, conditioning
    from vitp.parallel.distributed import resolve_device
    from vitp.train.wan import DIFFUSERS_DIR

    from .wan_sample import export_advice, lora_file_of, validate_run_lora, wan_denoisers

    folder = Path(run_dir) / (weights or DIFFUSERS_DIR)
    saved = load_run_yaml(Path(run_dir) / ".hydra" / "config.yaml")
    lora = OmegaConf.select(saved, "trainer.lora.enabled")
    adapters = Path(run_dir) / "lora" if lora and weights is None else None  # the base with the final adapters
    if adapters is not None and lora_file_of(adapters) is None:
        raise FileNotFoundError(f"{run_dir} is a LoRA run without its final adapters {adapters} (the run has not "
                                "finished): " + export_advice(run_dir, saved, f"vitp-eval {run_dir} --weights OUT",
                                                              merge=True))
    if adapters is None and folder.is_file():
        raise ValueError(f"--weights {weights}: a Wan run is evaluated from a diffusers folder, not a file; give "
                         f"{DIFFUSERS_DIR} (the run's final EMA weights) or a folder written by vitp-export {run_dir} "
                         "--format diffusers -o OUT")
    has_model = any((folder / p / "config.json").is_file() for p in ("", "transformer", "transformer_2"))
    if adapters is None and not has_model:
        why = ("a run that has not finished has none" if weights is None else
               "a Wan run's --weights is a diffusers transformer folder")  # not the run's state: the user's path
        raise FileNotFoundError(f"{folder} holds no diffusers Wan weights (config.json): {why}; "
                                + export_advice(run_dir, saved, f"vitp-eval {run_dir} --weights OUT", merge=bool(lora)))
    cfg = apply_overrides(typed_config(saved, Path(run_dir) / ".hydra" / "config.yaml"), overrides, "vitp-eval")
    if adapters is not None:  # the base the run adapted (trainer.init_from: where it is now) + RUN/lora
        cfg.trainer.lora.init_from = str(adapters)
    elif lora:  # --weights: a merged folder, evaluated as it is (no adapters on top)
        from vitp.config import LoraConfig

        cfg.trainer.lora = OmegaConf.structured(LoraConfig())
    if adapters is None:
        cfg.trainer.init_from = str(folder.resolve())
    if weights is not None:
        _check_same_model(cfg, weights, run_dir)
    validate_run_lora(cfg, adapters)  # the run's adapters on another base: named as trainer.init_from
    if cfg.eval.fid.num or cfg.eval.fvd.num:  # the VAE, feature networks and CLIP folder before any sample
        from .metrics import check_quality_inputs

        check_wan_quality(cfg)
        check_quality_inputs(cfg)
    if sharded:  # replicas of the whole model where one fits a device, unless a layout key is given
        from vitp.parallel.distributed import world_size

        from .launch import choose_layout
        from .wan_sample import build_wan_sharded

        cfg = choose_layout(cfg, overrides, world_size(), resolve_device(cfg.trainer.device), "vitp-eval")
        gen, share = build_wan_sharded(cfg, "vitp-eval")
    else:
        from vitp.eval.launch import check_layout_overrides

        check_layout_overrides(cfg, overrides, "vitp-eval")
        from vitp.models.wan_run import wan_source

        # the run's own transformer: an A14B low-noise expert's is transformer_2/ (as the sharded path reads)
        gen, share = wan_denoisers(cfg, (wan_source(cfg)[0],), resolve_device(cfg.trainer.device))[0], None
    cond = conditioning(cfg)
    train_ds, heldout_ds = conditioned(cond, *build_datasets(cfg.data, cfg.seed))
    return cfg, gen, share, train_ds, heldout_ds, cond


def run_wan_eval(run_dir: Path, weights: Optional[str], overrides: List[str], sharded: bool, out: Path,
                 step: Optional[int]) -> Dict[str, Any]:
    """``vitp-eval`` of a Wan run into ``out``: :func:`load_wan_for_eval` then :func:`wan_evaluate`
    (full). Returns rank 0's results (the held-out loss elsewhere)."""
    from vitp.models.wan_run import wan_source

    from .fid import sample_source, weights_identity

    cfg, gen, share, train_ds, heldout_ds, cond = load_wan_for_eval(run_dir, weights, overrides, sharded)
    pipe = sampling_pipeline(cfg)  # samples of other weights or another VAE are drawn again
    lora = [Path(cfg.trainer.lora.init_from)] if cfg.trainer.lora.enabled and cfg.trainer.lora.init_from else []
    source = weights_identity(wan_source(cfg)[0], *lora, *([pipe / "vae"] if pipe is not None and
                                                           (pipe / "vae").is_dir() else []))
    head = {"step": None, "weights": cfg.trainer.init_from} if weights is not None else None
    with sample_source(source):  # other weights: no step of the run's
        return wan_evaluate(gen, cfg, train_ds, heldout_ds, run_dir, full=True, step=None if head else step, out=out,
                            conditioning=cond, share=share, head=head)


__all__ = ["LATENT_PREVIEW", "check_wan_quality", "heldout_noise", "heldout_sigmas", "load_wan_for_eval",
           "run_wan_eval", "sampling_pipeline", "to_frames", "vae_digest", "wan_evaluate", "wan_heldout_loss",
           "wan_quality_metrics", "wan_samples", "wan_video_metrics", "write_wan_grid"]
