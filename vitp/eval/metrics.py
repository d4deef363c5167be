"""Evaluation that needs no downloads.

- Held-out flow-matching loss on a fixed grid of ``t`` with fixed noise seeds (comparable
  across runs and layouts).
- Digits: a small judge classifier trained here on the real training digits gives its
  accuracy on real held-out digits, the fraction of class-conditional samples it assigns to the
  requested class, and FD-digits, the Frechet distance in its feature space (not FID).
- Video: the temporal difference of samples against real held-out clips (:mod:`.temporal`).

``vitp-eval RUN_DIR [overrides]`` re-runs this on a finished run and rewrites ``eval.json``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from vitp.data.shards import as_packed_source
from vitp.models import Generator
from vitp.objectives import sample_seed, v_loss
from vitp.utils import atomic_write_text

from .judge import frechet_distance, judge_features, judge_metrics, load_or_train_judge
from .sampling import generate, heldout_label_samples
from .temporal import temporal_metrics

log = logging.getLogger("vitp")


@torch.no_grad()
def heldout_loss(gen: Generator, cfg: DictConfig, dataset: Any, batch_size: int = 256,
                 conditioning: Any = None) -> Dict[str, Any]:
    """Mean v-loss on the held-out set at ``t_k = (k + 0.5) / K`` for ``K = eval.t_grid``, with
    noise seeded by ``(eval.noise_seed, item, k)``; labels (captions) are not dropped.
    ``conditioning`` maps the items' ids to the model's inputs (:mod:`vitp.data.text`; default
    class labels)."""
    from vitp.data.text import ClassConditioning

    cond = conditioning if conditioning is not None else ClassConditioning(cfg.model.num_classes)
    K, device = cfg.eval.t_grid, next(gen.parameters()).device
    ts = [(k + 0.5) / K for k in range(K)]
    per_t = torch.zeros(K, dtype=torch.float64)
    n = len(dataset)
    for start in range(0, n, batch_size):
        idx = range(start, min(n, start + batch_size))
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
    per_t /= n
    return {"heldout_loss": per_t.mean().item(), "heldout_loss_per_t": {f"{t:.2f}": v for t, v in zip(ts, per_t.tolist())}}


def bucket_heldout_loss(gen: Generator, cfg: DictConfig, sets: Dict[str, Any], conditioning: Any = None
                        ) -> Dict[str, Any]:
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
        r, n = heldout_loss(gen, cfg, ds, conditioning=conditioning), len(ds)
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


def digits_metrics(gen: Generator, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path,
                   conditioning: Any = None) -> Dict[str, Any]:
    """Judge accuracy on real held-out digits, on class-conditional samples, and FD-digits.

    The samples use the held-out labels (or ``eval.num_samples`` of them, cycled), so
    ``fd_digits`` (samples vs real training digits) is comparable to ``fd_digits_real``
    (real held-out vs real training digits) at the same sample count. A text-conditional run
    (``conditioning`` given) samples with the held-out captions and is judged against their
    digits; with caption templates it also measures :func:`prompt_accuracy`.
    """
    x_tr, _ = _stack(train_ds)
    x_ho, ids_ho = _stack(heldout_ds)
    y_tr, y_ho = (torch.as_tensor(ds.labels, dtype=torch.long) for ds in (train_ds, heldout_ds))
    judge = load_or_train_judge(run_dir / "judge.safetensors", x_tr, y_tr,
                                epochs=cfg.eval.classifier_epochs, seed=cfg.seed)
    ids, samples = heldout_label_samples(gen, cfg, ids_ho, conditioning)
    n = len(ids)
    labels = y_ho.repeat(n // len(y_ho) + 1)[:n]  # the digit of each sample's caption (or label)
    f_tr, f_ho, f_gen = (judge_features(judge, v) for v in (x_tr, x_ho, samples))
    fd_real = frechet_distance(f_tr, f_ho)
    fd_gen = frechet_distance(f_tr, f_gen)
    extra = {}
    if getattr(conditioning, "text", False) and cfg.data.captions == "templates":
        extra = prompt_accuracy(gen, cfg, judge, conditioning.store)
    return {
        **extra,
        "judge_accuracy_real_heldout": judge_metrics(judge, x_ho, y_ho)["accuracy"],
        "sample_accuracy": judge_metrics(judge, samples, labels)["accuracy"],
        "fd_digits": fd_gen,
        "fd_digits_real": fd_real,
        "fd_digits_ratio": fd_gen / max(fd_real, 1e-12),
        "num_samples": n,
    }


def prompt_accuracy(gen: Generator, cfg: DictConfig, judge: Any, store: Any) -> Dict[str, Any]:
    """Whether samples show the digit their prompt names: ``eval.prompt_samples`` samples of
    every (template, digit) prompt, for the training phrasings (``data.caption_templates``,
    ``prompt_accuracy_seen``) and phrasings never trained on (``eval.unseen_prompt_templates``,
    ``prompt_accuracy_unseen``; encoded with ``data.text_encoder``), judged by the digits judge.
    Also ``prompt_accuracy/<template>`` per template."""
    from vitp.data.text import PromptConditioning, fill_template

    res: Dict[str, Any] = {}
    k = cfg.eval.prompt_samples
    for group, templates in (("seen", cfg.data.caption_templates), ("unseen", cfg.eval.unseen_prompt_templates)):
        if not templates:
            continue
        prompts = [fill_template(t, str(d)) for t in templates for d in range(10)]
        digits = torch.arange(10).repeat(len(templates)).repeat_interleave(k)
        cond = PromptConditioning(prompts, store, cfg.data.text_encoder)
        ids = torch.arange(1, len(prompts) + 1).repeat_interleave(k)
        samples = generate(gen, cfg, ids, seed=cfg.eval.noise_seed + 2, conditioning=cond)
        res[f"prompt_accuracy_{group}"] = judge_metrics(judge, samples, digits)["accuracy"]
        for i, t in enumerate(templates):
            part = slice(i * 10 * k, (i + 1) * 10 * k)
            res[f"prompt_accuracy/{t}"] = judge_metrics(judge, samples[part], digits[part])["accuracy"]
    return res


def video_metrics(gen: Generator, cfg: DictConfig, heldout_ds: Any, conditioning: Any = None) -> Dict[str, Any]:
    """Temporal consistency of samples vs real held-out clips: mean absolute frame-to-frame
    difference (units of the [-1, 1] range; :func:`vitp.eval.temporal.temporal_consistency`), for
    ``eval.num_samples`` samples (0 = one per held-out clip) with the held-out labels."""
    x_ho, y_ho = _stack(heldout_ds)
    labels, samples = heldout_label_samples(gen, cfg, y_ho, conditioning)
    return {**temporal_metrics(samples, x_ho), "num_samples": len(labels)}


def evaluate(gen: Generator, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path, *, full: bool = True,
             step: Optional[int] = None, logger: Any = None, buckets: Optional[Dict[str, Any]] = None,
             out: Optional[Path] = None, conditioning: Any = None) -> Dict[str, Any]:
    """Held-out loss (always; with ``buckets``, ``{name: held-out items}``, per bucket and overall,
    :func:`bucket_heldout_loss`) and, when ``full`` and the data are digits, the judge metrics
    (video: temporal statistics) at ``data.resolution``. With ``full`` the results are written
    to ``out`` (default ``run_dir/eval.json``; the judge is cached in ``run_dir`` either way);
    with ``logger`` and ``step`` the floats go to TensorBoard as ``eval/<key>``. ``conditioning``:
    how item ids become model inputs (:mod:`vitp.data.text`; default class labels)."""
    cfg = as_packed_source(cfg, heldout_ds)  # packed digits are judged as the digits
    res: Dict[str, Any] = {"step": step} if step is not None else {}
    if buckets:
        res.update(bucket_heldout_loss(gen, cfg, buckets, conditioning))
    elif len(heldout_ds):
        res.update(heldout_loss(gen, cfg, heldout_ds, conditioning=conditioning))
    if full and cfg.data.name == "digits" and len(heldout_ds) > 1:
        res.update(digits_metrics(gen, cfg, train_ds, heldout_ds, run_dir, conditioning))
        res["sampler"] = OmegaConf.to_container(cfg.sampler, resolve=True)
    if full and cfg.model.num_frames > 1 and len(heldout_ds):
        res.update(video_metrics(gen, cfg, heldout_ds, conditioning))
        res["sampler"] = OmegaConf.to_container(cfg.sampler, resolve=True)
    if logger is not None and step is not None:
        logger.scalars(step, {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}, jsonl=False)
    if full:
        atomic_write_text(out if out is not None else Path(run_dir) / "eval.json", json.dumps(res, indent=2) + "\n")
        log.info("eval: %s", {k: v for k, v in res.items() if isinstance(v, (int, float))})
    return res
