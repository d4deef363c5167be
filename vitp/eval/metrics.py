"""Evaluation that needs no downloads.

- Held-out flow-matching loss on a fixed grid of ``t`` with fixed noise seeds (comparable
  across runs and layouts).
- Digits: a small judge classifier trained here on the real training digits gives its
  accuracy on real held-out digits, the fraction of class-conditional samples it assigns to the
  requested class, and FD-digits, the Frechet distance in its feature space (not FID).
- Video: the temporal difference of samples against real held-out clips (:mod:`.temporal`).

``vitp-eval RUN_DIR [overrides]`` re-runs this on a finished run into its own file, keeping the
training's ``eval.json`` (:func:`vitp.cli.eval.eval_output`).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from vitp.data.shards import as_packed_source
from vitp.objectives import sample_seed, v_loss
from vitp.utils import atomic_write_text

from .judge import frechet_distance, judge_features, judge_metrics, load_or_train_judge
from .inference import Share
from .progress import check_stop, common_batches, phase
from .sampling import _device, generate, heldout_label_samples, to_pixels
from .temporal import temporal_ratio, temporal_sums

log = logging.getLogger("vitp")



def eval_batch_size(cfg: DictConfig) -> int:
    """Held-out items per forward call of a replica: the training micro-batch times the pipeline
    stages (``trainer.micro_batch_size * parallel.pp``), so an evaluation batch needs no more
    memory than a training micro-batch and fills the pipeline."""
    return int(cfg.trainer.micro_batch_size) * int(cfg.parallel.pp)


@torch.no_grad()
def heldout_loss(gen: Any, cfg: DictConfig, dataset: Any, batch_size: Optional[int] = None,
                 conditioning: Any = None, share: Optional[Share] = None, label: str = "") -> Dict[str, Any]:
    """Mean v-loss on the held-out set at ``t_k = (k + 0.5) / K`` for ``K = eval.t_grid``, with
    noise seeded by ``(eval.noise_seed, item, k)``; labels (captions) are not dropped.
    ``conditioning`` maps the items' ids to the model's inputs (:mod:`vitp.data.text`; default
    class labels). Items go through ``gen`` (a :class:`vitp.models.Generator` or a
    :class:`vitp.eval.inference.StageDenoiser`) ``batch_size`` at a time (default
    :func:`eval_batch_size`); with ``share`` each data-parallel replica takes its range of the
    items and the per-``t`` sums are added over the replicas (float64; collective, the result on
    every rank). ``label`` names the set in the progress line (:mod:`.progress`)."""
    from vitp.data.text import ClassConditioning

    share = share or Share()
    cond = conditioning if conditioning is not None else ClassConditioning(cfg.model.num_classes)
    K, device = cfg.eval.t_grid, _device(gen)
    batch_size = batch_size or eval_batch_size(cfg)
    ts = [(k + 0.5) / K for k in range(K)]
    per_t = torch.zeros(K, dtype=torch.float64)
    n, mine = len(dataset), share.indices(len(dataset))
    what = f"held-out loss of {n} items at {K} noise levels{f' ({label})' if label else ''}"
    common = common_batches(n, share.size, batch_size)  # a stop request is asked after each of their forwards
    with phase(what, -(-len(mine) // batch_size) * K, "held-out loss", "forward", share.main) as bar:
        for b, start in enumerate(range(mine.start, mine.stop, batch_size)):
            idx = range(start, min(mine.stop, start + batch_size))
            items = [dataset[(i, None)] for i in idx]
            x = torch.stack([it[0] for it in items])
            y = tuple(v.to(device) for v in cond(torch.tensor([int(it[1]) for it in items])))
            for k, t in enumerate(ts):
                eps = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(
                    sample_seed(cfg.eval.noise_seed, i, k))) for i in idx])
                tb = torch.full((len(x),), t)
                z = t * x + (1 - t) * cfg.objective.noise_scale * eps
                x_pred = gen(z.to(device), tb.to(device), *y).float().cpu()
                per_t[k] += v_loss(x_pred, x, z, tb, cfg.objective.t_eps).double().sum()
                bar.update(1)
                check_stop(b < common)
    per_t = share.sum(per_t) / n
    return {"heldout_loss": per_t.mean().item(), "heldout_loss_per_t": {f"{t:.2f}": v for t, v in zip(ts, per_t.tolist())}}


def bucket_heldout_loss(gen: Any, cfg: DictConfig, sets: Dict[str, Any], conditioning: Any = None,
                        share: Optional[Share] = None) -> Dict[str, Any]:
    """:func:`heldout_loss` per shape bucket: ``sets`` maps a bucket name (``"HxW"`` or
    ``"HxWxT"``) to its held-out items, assigned to buckets as the training items are
    (:func:`vitp.data.buckets.assign`) and rendered at the bucket's shape. Returns
    ``heldout_loss/<name>`` and ``heldout_items/<name>`` per non-empty bucket, and the overall
    ``heldout_loss`` (and ``heldout_loss_per_t``): the mean over all (item, bucket) pairs, i.e.
    the bucket losses weighted by their item counts."""
    res: Dict[str, Any] = {}
    total, per_t, n_all = 0.0, {}, 0
    for name, ds in sets.items():
        if not len(ds):
            continue
        r, n = heldout_loss(gen, cfg, ds, conditioning=conditioning, share=share, label=f"bucket {name}"), len(ds)
        res[f"heldout_loss/{name}"], res[f"heldout_items/{name}"] = r["heldout_loss"], n
        total, n_all = total + n * r["heldout_loss"], n_all + n
        for t, v in r["heldout_loss_per_t"].items():
            per_t[t] = per_t.get(t, 0.0) + n * v
    if n_all:
        res["heldout_loss"] = total / n_all
        res["heldout_loss_per_t"] = {t: v / n_all for t, v in per_t.items()}
    return res


def _stack(dataset: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[(i, None)] for i in range(len(dataset))]
    return torch.stack([it[0] for it in items]), torch.tensor([int(it[1]) for it in items])


def item_ids(dataset: Any) -> torch.Tensor:
    """``(N,)`` the model-input ids of a data set's items (caption ids of a captioned set, else
    labels), without reading the items when the data set lists them."""
    ids = getattr(dataset, "ids", None)
    if ids is None and not hasattr(dataset, "captions"):
        ids = getattr(dataset, "labels", None)
    if ids is None:
        return torch.tensor([int(dataset[(i, None)][1]) for i in range(len(dataset))])
    return torch.as_tensor(np.asarray(ids), dtype=torch.long)


def digits_metrics(gen: Any, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path,
                   conditioning: Any = None, share: Optional[Share] = None) -> Dict[str, Any]:
    """Judge accuracy on real held-out digits, on class-conditional samples, and FD-digits.

    The samples use the held-out labels (or ``eval.num_samples`` of them, cycled), so
    ``fd_digits`` (samples vs real training digits) is comparable to ``fd_digits_real``
    (real held-out vs real training digits) at the same sample count. A text-conditional run
    (``conditioning`` given) samples with the held-out captions and is judged against their
    digits; with caption templates it also measures :func:`prompt_accuracy`. With ``share`` the
    samples are made on every replica and judged on rank 0 (``{}`` elsewhere; collective).
    """
    share = share or Share()
    ids, samples = heldout_label_samples(gen, cfg, item_ids(heldout_ds), conditioning, share)
    prompts = []  # made on every replica before rank 0 trains the judge
    if getattr(conditioning, "text", False) and cfg.data.captions == "templates":
        prompts = prompt_samples(gen, cfg, conditioning.store, share)
    if not share.main:
        return {}
    x_tr, _ = _stack(train_ds)
    x_ho, _ = _stack(heldout_ds)
    y_tr, y_ho = (torch.as_tensor(ds.labels, dtype=torch.long) for ds in (train_ds, heldout_ds))
    judge = load_or_train_judge(run_dir / "judge.safetensors", x_tr, y_tr,
                                epochs=cfg.eval.classifier_epochs, seed=cfg.seed)
    n = len(ids)
    labels = y_ho.repeat(n // len(y_ho) + 1)[:n]  # the digit of each sample's caption (or label)
    f_tr, f_ho, f_gen = (judge_features(judge, v) for v in (x_tr, x_ho, samples))
    fd_real = frechet_distance(f_tr, f_ho)
    fd_gen = frechet_distance(f_tr, f_gen)
    return {
        **prompt_accuracy(judge, cfg, prompts),
        "judge_accuracy_real_heldout": judge_metrics(judge, x_ho, y_ho)["accuracy"],
        "sample_accuracy": judge_metrics(judge, samples, labels)["accuracy"],
        "fd_digits": fd_gen,
        "fd_digits_real": fd_real,
        "fd_digits_ratio": fd_gen / max(fd_real, 1e-12),
        "num_samples": n,
    }


def prompt_samples(gen: Any, cfg: DictConfig, store: Any, share: Optional[Share] = None
                   ) -> List[Tuple[str, List[str], torch.Tensor, torch.Tensor]]:
    """Samples of every (template, digit) prompt, ``eval.prompt_samples`` each, for the training
    phrasings (``data.caption_templates``, group ``"seen"``) and phrasings never trained on
    (``eval.unseen_prompt_templates``, ``"unseen"``; encoded with ``data.text_encoder``):
    ``[(group, templates, samples (n, C, T, H, W), digits (n,))]``, template-major. With ``share``
    the samples are split over the replicas and gathered on rank 0 (``[]`` elsewhere; collective)."""
    from vitp.data.text import PromptConditioning, fill_template

    out = []
    k = cfg.eval.prompt_samples
    for group, templates in (("seen", cfg.data.caption_templates), ("unseen", cfg.eval.unseen_prompt_templates)):
        if not templates:
            continue
        prompts = [fill_template(t, str(d)) for t in templates for d in range(10)]
        cond = PromptConditioning(prompts, store, cfg.data.text_encoder)
        ids = torch.arange(1, len(prompts) + 1).repeat_interleave(k)
        samples = generate(gen, cfg, ids, seed=cfg.eval.noise_seed + 2, conditioning=cond, share=share,
                           purpose=f"the prompt accuracy ({group} phrasings)")
        if samples is not None:
            out.append((group, list(templates), samples, torch.arange(10).repeat(len(templates)).repeat_interleave(k)))
    return out


def prompt_accuracy(judge: Any, cfg: DictConfig, parts: List[Tuple[str, List[str], torch.Tensor, torch.Tensor]]
                    ) -> Dict[str, float]:
    """Whether the :func:`prompt_samples` ``parts`` show the digit their prompt names, by the digits
    judge: ``prompt_accuracy_seen`` / ``prompt_accuracy_unseen``, and ``prompt_accuracy/<template>``
    per template."""
    res: Dict[str, float] = {}
    n = 10 * cfg.eval.prompt_samples  # samples per template
    for group, templates, samples, digits in parts:
        res[f"prompt_accuracy_{group}"] = judge_metrics(judge, samples, digits)["accuracy"]
        for i, t in enumerate(templates):
            part = slice(i * n, (i + 1) * n)
            res[f"prompt_accuracy/{t}"] = judge_metrics(judge, samples[part], digits[part])["accuracy"]
    return res


def video_metrics(gen: Any, cfg: DictConfig, heldout_ds: Any, conditioning: Any = None,
                  share: Optional[Share] = None) -> Dict[str, Any]:
    """Temporal consistency of samples vs real held-out clips: mean absolute frame-to-frame
    difference (units of the [-1, 1] range; :func:`vitp.eval.temporal.temporal_consistency`), for
    ``eval.num_samples`` samples (0 = one per held-out clip) with the held-out labels. Streams:
    each replica (``share``) sums the differences of its own samples and its range of the
    held-out clips, one batch at a time; only the sums are added over the replicas (collective,
    the result on every rank)."""
    share = share or Share()
    y_ho = item_ids(heldout_ds)
    n = cfg.eval.num_samples or len(y_ho)
    labels = y_ho.repeat(n // len(y_ho) + 1)[:n]
    gen_sums = temporal_sums(generate(gen, cfg, labels, seed=cfg.eval.noise_seed + 1, conditioning=conditioning,
                                      share=share, gather=False, purpose="the temporal statistics"))
    real_sums = torch.zeros(2, dtype=torch.float64)
    for i in share.indices(len(heldout_ds)):  # latents: decoded as the samples are
        real_sums += temporal_sums(to_pixels(cfg, heldout_ds[(i, None)][0][None], _device(gen)))
    sums = share.sum(torch.cat([gen_sums, real_sums]))
    return {**temporal_ratio(sums[:2], sums[2:]), "num_samples": n}


def sampler_record(cfg: DictConfig) -> Dict[str, Any]:
    """``cfg.sampler`` as ``eval.json`` records it, ``grid_classes`` as the rows the grid had
    (:func:`vitp.eval.sampling.class_grid_labels`: at most ``model.num_classes``, 0 = all of them;
    a 2-class run showed the default 10)."""
    rec = OmegaConf.to_container(cfg.sampler, resolve=True)
    classes = int(cfg.model.num_classes)
    if not int(getattr(cfg.model, "text_dim", 0) or 0) and classes > 0:
        rec["grid_classes"] = min(int(rec["grid_classes"]) or classes, classes)
    return rec


def evaluate(gen: Any, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path, *, full: bool = True,
             step: Optional[int] = None, logger: Any = None, buckets: Optional[Dict[str, Any]] = None,
             out: Optional[Path] = None, conditioning: Any = None, share: Optional[Share] = None,
             weights: Optional[str] = None) -> Dict[str, Any]:
    """Held-out loss (always; with ``buckets``, ``{name: held-out items}``, per bucket and overall,
    :func:`bucket_heldout_loss`) and, when ``full`` and the data are digits, the judge metrics
    (video: temporal statistics) at ``data.resolution``; with ``full`` and ``eval.fid.num``, FID
    (:func:`vitp.eval.fid.fid_metrics`, its samples in ``out`` with the suffix ``.npz``) and, with
    ``eval.clip.model``, the CLIP score of those samples (:func:`quality_metrics`); with ``full``,
    ``eval.fvd.num`` and a video run, FVD (:func:`vitp.eval.fvd.fvd_metrics`, clips in ``.fvd.npz``).
    With ``full`` the results are written
    to ``out`` (default ``run_dir/eval.json``; the judge is cached in ``run_dir`` either way);
    with ``logger`` and ``step`` the floats go to TensorBoard as ``eval/<key>``. ``conditioning``:
    how item ids become model inputs (:mod:`vitp.data.text`; default class labels). ``weights``: the
    file scored, recorded as ``weights`` (``vitp-eval``).

    ``gen``: a :class:`vitp.models.Generator`, or with ``share`` (:class:`vitp.eval.inference.Share`)
    this rank's :class:`vitp.eval.inference.StageDenoiser`: then every rank calls this, the work
    is split over the replicas, and rank 0 alone writes and returns the full results (the other
    ranks return the held-out loss)."""
    share = share or Share()
    cfg = as_packed_source(cfg, heldout_ds)  # packed digits are judged as the digits
    res: Dict[str, Any] = {"step": step} if step is not None else {}
    if weights is not None:
        res["weights"] = weights
    if buckets:
        res.update(bucket_heldout_loss(gen, cfg, buckets, conditioning, share))
    elif len(heldout_ds):
        res.update(heldout_loss(gen, cfg, heldout_ds, conditioning=conditioning, share=share))
    if full and cfg.data.name == "digits" and len(heldout_ds) > 1 and not cfg.data.get("latent_channels"):
        res.update(digits_metrics(gen, cfg, train_ds, heldout_ds, run_dir, conditioning, share))
        res["sampler"] = sampler_record(cfg)
    if full and cfg.model.num_frames > 1 and len(heldout_ds):
        res.update(video_metrics(gen, cfg, heldout_ds, conditioning, share))
        res["sampler"] = sampler_record(cfg)
    if full:
        base = Path(out) if out is not None else Path(run_dir) / "eval.json"
        res.update(fid_and_fvd(gen, cfg, train_ds, heldout_ds, run_dir, base.with_suffix(".npz"),
                               base.with_suffix(".fvd.npz"), conditioning, share))
    return report(res, share, logger, step, full, run_dir, out)


def fid_and_fvd(gen: Any, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path, npz: Path, clips: Path,
                conditioning: Any = None, share: Optional[Share] = None) -> Dict[str, Any]:
    """With ``eval.fid.num``, :func:`quality_metrics` (FID, CLIP score) of samples in ``npz``; with
    ``eval.fvd.num`` and a video run, FVD (:func:`vitp.eval.fvd.fvd_metrics`) of clips in ``clips``.
    When FID's samples are the first frames of FVD's clips (same count, seed and blocks,
    :func:`vitp.eval.fid.first_frames_are_fid_samples`) the clips are drawn once and FID reads their
    first frames: the same ``npz`` and numbers, without sampling twice. Rank 0's results (``{}``
    elsewhere). Collective."""
    from .fid import fid_labels, fid_samples_from_clips, first_frames_are_fid_samples
    from .fvd import fvd_metrics

    share, res, fvd = share or Share(), {}, {}
    ids = item_ids(heldout_ds) if len(heldout_ds) else None
    video = cfg.eval.fvd.num and cfg.model.num_frames > 1
    if cfg.eval.fid.num and video and first_frames_are_fid_samples(cfg):
        from .clip_score import check_clip

        check_clip(cfg, conditioning)  # before the clips are drawn, as before FID's samples
        fvd = fvd_metrics(gen, cfg, train_ds, heldout_ds, run_dir, clips, conditioning, share, ids)
        labels = fid_labels(cfg, conditioning, ids if ids is not None else torch.zeros(1, dtype=torch.long))
        fid_samples_from_clips(cfg, clips, npz, labels, share)  # quality_metrics then reuses this npz
    if cfg.eval.fid.num:
        res.update(quality_metrics(gen, cfg, train_ds, heldout_ds, run_dir, npz, conditioning, share))
    if video and not fvd:
        fvd = fvd_metrics(gen, cfg, train_ds, heldout_ds, run_dir, clips, conditioning, share, ids)
    return {**res, **fvd}


def quality_metrics(gen: Any, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path, npz: Path,
                    conditioning: Any = None, share: Optional[Share] = None) -> Dict[str, Any]:
    """The field's quality numbers of ``eval.fid.num`` samples written to ``npz``: FID
    (:func:`vitp.eval.fid.fid_metrics`) and, with ``eval.clip.model``, the CLIP score of those
    samples against their captions (:func:`vitp.eval.clip_score.clip_metrics`; its folder checked
    before they are drawn); at the end of a run (:func:`evaluate`) and every ``eval.fid.every``
    steps of training. Rank 0's results (``{}`` elsewhere). Collective."""
    from .clip_score import check_clip, clip_metrics
    from .fid import fid_metrics

    share = share or Share()
    clip = check_clip(cfg, conditioning)  # before the FID samples are drawn
    ids = item_ids(heldout_ds) if len(heldout_ds) else None
    res = fid_metrics(gen, cfg, train_ds, heldout_ds, run_dir, npz, conditioning, share, ids)
    if clip is not None:  # a caption run: the same samples against their captions
        res.update(clip_metrics(cfg, npz, conditioning, share, _device(gen)))
    return res


def check_quality_inputs(cfg: Any, fvd: Optional[bool] = None) -> None:
    """The files an evaluation with ``eval.fid.num`` (and, with ``fvd``, default ``eval.fvd.num``)
    reads, checked before any step or sample: the Inception file, the CLIP folder
    (``eval.clip.model``) and a given FID real-statistics cache; the I3D file of a video run
    (:func:`vitp.eval.fvd.check_fvd`, which refuses an image run) and a given FVD cache. Raises as
    those checks do, naming the key and the fix."""
    from .clip_score import check_clip
    from .fid import check_real_cache, check_weights
    from .fvd import check_fvd

    if cfg.eval.fid.num:
        check_weights(cfg.eval.fid.weights)
        check_clip(cfg)
        check_real_cache(cfg, "fid")
    if cfg.eval.fvd.num if fvd is None else fvd:
        check_fvd(cfg)
        check_real_cache(cfg, "fvd")


def _no_split_fix(cfg: Any, existing: bool = False) -> str:
    """How to get held-out items. ``existing``: vitp-eval of a trained run, whose split is fixed
    (``vitp.cli.eval.check_split_overrides`` refuses another ``data.holdout_fraction``; only a
    folder run takes ``data.heldout_root=DIR``)."""
    d = cfg.data
    if existing:
        folder = ("hold out another folder with data.heldout_root=DIR, or " if str(d.name) in
                  ("image_folder", "video_folder") else "")
        return f"{folder}train a new run with a larger data.holdout_fraction (this run's split is fixed)"
    if d.heldout_root:
        return f"add items to data.heldout_root={d.heldout_root}"
    if d.holdout_fraction:  # too few for the fraction: a class holds out round(fraction * n), at least 1
        return f"raise data.holdout_fraction (now {d.holdout_fraction:g}) or hold out a folder with data.heldout_root=DIR"
    return "hold out a split with data.holdout_fraction > 0 or data.heldout_root=DIR"


def check_real_split(cfg: Any, heldout_items: int, existing: bool = False) -> None:
    """Once the split is known, before any step or sample: FID (``eval.fid.num``) or a video run's
    FVD (``eval.fvd.num``) against ``eval.<metric>.real=heldout`` needs at least 2 held-out items
    (``heldout_items`` of them). Raises ``ValueError`` (one line) naming the key and the fixes
    (``eval.<metric>.real=train``, or more held-out items: what works for a trained run when
    ``existing``, vitp-eval's case); a run used to train to its end first."""
    for section, name, on in (("fid", "FID", bool(cfg.eval.fid.num)),
                              ("fvd", "FVD", bool(cfg.eval.fvd.num) and int(cfg.model.num_frames) > 1)):
        if on and cfg.eval[section].real == "heldout" and heldout_items < 2:
            d = cfg.data
            why = "" if d.heldout_root else f" (data.holdout_fraction={d.holdout_fraction:g})"
            train = f"score against the training items with eval.{section}.real=train"
            fixes = f"{train}, or {_no_split_fix(cfg, True)}" if existing else f"{_no_split_fix(cfg)}, or {train}"
            raise ValueError(f"eval.{section}.real=heldout but the run has {heldout_items} held-out item"
                             f"{'' if heldout_items == 1 else 's'}{why}, and {name} needs at least 2 real items: "
                             f"{fixes}")


def evaluation_notes(cfg: Any, heldout_items: int, existing: bool = False) -> List[str]:
    """What an evaluation of ``cfg`` leaves out, said once at its start (an evaluation used to log only
    ``{'step': N}``): the held-out loss (and a video run's temporal statistics) without held-out items,
    and FVD (``eval.fvd.num``) of an image run, which training skips. ``existing``: as
    :func:`check_real_split`."""
    notes = []
    if not heldout_items:
        video = " and the temporal statistics" if int(cfg.model.num_frames) > 1 else ""
        why = "data.holdout_fraction=0" if not cfg.data.heldout_root and not cfg.data.holdout_fraction else \
            "the held-out set is empty"
        notes.append(f"evaluation: no held-out items ({why}): the held-out loss{video} are off; "
                     f"{_no_split_fix(cfg, existing)}")
    if cfg.eval.fvd.num and int(cfg.model.num_frames) < 2:
        notes.append(f"evaluation: eval.fvd.num={cfg.eval.fvd.num} is skipped: FVD scores videos, but this run makes "
                     f"images (model.num_frames={cfg.model.num_frames}); use eval.fid.num for images")
    return notes


def rank_peaks(every_rank: bool = True) -> list:
    """Every rank's resident-memory peak (``VmHWM`` of ``/proc/self/status``, MiB, 0 where the
    system has none), in rank order: collective over the world when ``every_rank`` (every rank
    runs this evaluation) and a process group is up, else this process's alone."""
    try:
        mine = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        mine = 0.0
    if not (every_rank and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [round(mine, 1)]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, round(mine, 1))
    return out


def report(res: Dict[str, Any], share: Any, logger: Any, step: Optional[int], full: bool, run_dir: Any,
           out: Optional[Path]) -> Dict[str, Any]:
    """Rank 0's part of an evaluation: its float results to TensorBoard (``eval/<key>``) and, for a
    full one, ``peak_rss_mib`` (every rank's resident-memory peak so far, :func:`rank_peaks`),
    ``eval.json`` (or ``out``) and a log line; returns ``res``. Collective when ``full`` and
    ``share.group`` is set (a distributed evaluation)."""
    if full:  # every rank's of a distributed evaluation (share.group), this process's of a one-process one
        res = {**res, "peak_rss_mib": rank_peaks(share.group is not None)}
    if not share.main:
        return res
    if logger is not None and step is not None:
        logger.scalars(step, {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}, jsonl=False)
    if full:
        atomic_write_text(out if out is not None else Path(run_dir) / "eval.json", json.dumps(res, indent=2) + "\n")
        log.info("eval: %s", {k: v for k, v in res.items() if isinstance(v, (int, float))})
    return res
