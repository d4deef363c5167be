"""Evaluation that needs no downloads, sample grids, and the consolidated weight files.

- Held-out flow-matching loss on a fixed grid of ``t`` with fixed noise seeds (comparable
  across runs and layouts).
- Digits: a small judge classifier trained here on the real training digits gives its
  accuracy on real held-out digits, the fraction of class-conditional samples it assigns to the
  requested class, and FD-digits, the Frechet distance in its feature space (not FID).

``vitp-eval RUN_DIR [overrides]`` re-runs this on a finished run and rewrites ``eval.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from .models import Generator
from .objectives import sample, velocity
from .objectives.flow import sample_seed

log = logging.getLogger("vitp")


def _model_cfg(model_cfg: Any) -> Dict[str, Any]:
    if isinstance(model_cfg, DictConfig):
        return OmegaConf.to_container(model_cfg, resolve=True)
    return dict(model_cfg)


def generator_from_state(model_cfg: Any, state: Dict[str, torch.Tensor], device: torch.device | str = "cpu") -> Generator:
    """A :class:`Generator` in eval mode holding ``state`` (strict key match)."""
    gen = Generator(_model_cfg(model_cfg))
    gen.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return gen.to(device).eval()


def save_weights(run_dir: Path, cfg: DictConfig, ema_state: Dict[str, torch.Tensor],
                 raw_state: Dict[str, torch.Tensor], step: Optional[int] = None) -> None:
    """Write ``model_ema.safetensors`` and ``model.safetensors`` (+ ``.json`` sidecars) in the
    export layout of :mod:`vitp.checkpoint` (full fp32 tensors, timm names for the blocks, the
    run config as metadata). Each file is written to a temporary name and renamed, so a crash
    never leaves a half-written file under the final name."""
    from .checkpoint import save_export

    save_export(run_dir / "model_ema.safetensors", ema_state, cfg, step=step, weights="ema")
    save_export(run_dir / "model.safetensors", raw_state, cfg, step=step, weights="raw")


def load_weights(path: str | os.PathLike, device: torch.device | str = "cpu") -> Tuple[Generator, DictConfig]:
    """``(generator in eval mode, run config)`` from a vitp weights file (an export, or the
    ``model*.safetensors`` of a run directory).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, corrupt,
    or not written by vitp.
    """
    from .checkpoint import read_export

    state, meta = read_export(path)
    cfg = OmegaConf.create(json.loads(meta["vitp_config"]))
    return generator_from_state(cfg.model, state, device), cfg


def class_grid_labels(num_classes: int, per_class: int, max_rows: int = 0) -> torch.Tensor:
    """``[c0]*per_class + [c1]*per_class + ...``: one grid row per class; with ``max_rows`` only
    that many classes, evenly spaced over ``[0, num_classes)``."""
    rows = num_classes if not max_rows or max_rows >= num_classes else max_rows
    classes = torch.linspace(0, num_classes - 1, rows).round().long()
    return classes.repeat_interleave(per_class)


def generate(gen: Generator, cfg: DictConfig, labels: torch.Tensor, seed: int) -> torch.Tensor:
    """Samples ``(B, C, T, H, W)`` for ``labels`` with the configured sampler, in batches."""
    s, m = cfg.sampler, cfg.model
    shape = (m.in_channels, m.num_frames, m.image_size, m.image_size)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(labels), *shape), generator=g)
    out = []
    for i in range(0, len(labels), s.batch_size):
        out.append(sample(gen, labels[i:i + s.batch_size], shape, num_classes=m.num_classes, steps=s.steps,
                          method=s.method, cfg_scale=s.cfg_scale, cfg_interval=tuple(s.cfg_interval),
                          noise_scale=cfg.objective.noise_scale, t_eps=cfg.objective.t_eps,
                          noise=noise[i:i + s.batch_size]).cpu())
    return torch.cat(out)


def to_grid(x: torch.Tensor, nrow: int, min_tile: int = 64) -> torch.Tensor:
    """``(B, C, T, H, W)`` in [-1, 1] -> a ``(3, H', W')`` float grid in [0, 1] of the first
    frames, upscaled (nearest) so each tile is at least ``min_tile`` pixels."""
    from torchvision.utils import make_grid

    img = (x[:, :, 0].float() + 1) / 2
    scale = max(1, min_tile // img.shape[-1])
    if scale > 1:
        img = torch.nn.functional.interpolate(img, scale_factor=scale, mode="nearest")
    return make_grid(img.clamp(0, 1), nrow=nrow, padding=2, pad_value=1.0)


def write_sample_grid(gen: Generator, cfg: DictConfig, path: Path) -> Dict[str, Any]:
    """Write the fixed-seed class grid (one row per class) as PNG (first frames) at ``path``; for
    video (``num_frames > 1``) also one GIF per class and seed plus ``grid.gif`` in the folder
    ``path`` without its suffix (e.g. ``samples/step_0000500/``), at ``sampler.fps``.

    Returns ``{"grid": (3, H', W') in [0, 1], "strips": (rows, 3, H, T * W) in [0, 1] or None}``;
    the strips (each class row's first sample, frames side by side) are TensorBoard's view of the videos.
    """
    from torchvision.utils import save_image

    labels = class_grid_labels(cfg.model.num_classes, cfg.sampler.samples_per_class, cfg.sampler.grid_classes)
    x = generate(gen, cfg, labels, cfg.sampler.seed)
    grid = to_grid(x, nrow=cfg.sampler.samples_per_class)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, str(path))
    strips = None
    if x.shape[2] > 1:
        from .video_io import frame_strip, write_video_samples

        write_video_samples(x, labels, path.parent, name=path.stem, fps=cfg.sampler.fps)
        strips = frame_strip(x[::cfg.sampler.samples_per_class], padding=1, min_tile=32)
    return {"grid": grid, "strips": strips}


@torch.no_grad()
def heldout_loss(gen: Generator, cfg: DictConfig, dataset: Any, batch_size: int = 256) -> Dict[str, Any]:
    """Mean v-loss on the held-out set at ``t_k = (k + 0.5) / K`` for ``K = eval.t_grid``, with
    noise seeded by ``(eval.noise_seed, item, k)``; labels are not dropped."""
    K, device = cfg.eval.t_grid, next(gen.parameters()).device
    ts = [(k + 0.5) / K for k in range(K)]
    per_t = torch.zeros(K, dtype=torch.float64)
    n = len(dataset)
    for start in range(0, n, batch_size):
        idx = range(start, min(n, start + batch_size))
        items = [dataset[(i, None)] for i in idx]
        x = torch.stack([it[0] for it in items])
        y = torch.tensor([int(it[1]) for it in items])
        for k, t in enumerate(ts):
            eps = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(
                sample_seed(cfg.eval.noise_seed, i, k))) for i in idx])
            tb = torch.full((len(x),), t)
            z = t * x + (1 - t) * cfg.objective.noise_scale * eps
            x_pred = gen(z.to(device), tb.to(device), y.to(device)).float().cpu()
            err = velocity(x_pred, z, tb, cfg.objective.t_eps) - velocity(x, z, tb, cfg.objective.t_eps)
            per_t[k] += err.pow(2).flatten(1).mean(1).double().sum()
    per_t /= n
    return {"heldout_loss": per_t.mean().item(), "heldout_loss_per_t": {f"{t:.2f}": v for t, v in zip(ts, per_t.tolist())}}


def _stack(dataset: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[(i, None)] for i in range(len(dataset))]
    return torch.stack([it[0] for it in items]), torch.tensor([int(it[1]) for it in items])


def heldout_label_samples(gen: Generator, cfg: DictConfig, y_ho: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(labels, samples)``: ``eval.num_samples`` (0 = as many as held-out items) samples with the
    held-out labels (cycled), from the fixed seed ``eval.noise_seed + 1``."""
    n = cfg.eval.num_samples or len(y_ho)
    labels = y_ho.repeat(n // len(y_ho) + 1)[:n]
    return labels, generate(gen, cfg, labels, seed=cfg.eval.noise_seed + 1)


def digits_metrics(gen: Generator, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path) -> Dict[str, Any]:
    """Judge accuracy on real held-out digits, on class-conditional samples, and FD-digits.

    The samples use the held-out labels (or ``eval.num_samples`` of them, cycled), so
    ``fd_digits`` (samples vs real training digits) is comparable to ``fd_digits_real``
    (real held-out vs real training digits) at the same sample count.
    """
    from .judge import frechet_distance, judge_features, judge_metrics, load_or_train_judge

    x_tr, y_tr = _stack(train_ds)
    x_ho, y_ho = _stack(heldout_ds)
    judge = load_or_train_judge(run_dir / "judge.safetensors", x_tr, y_tr,
                                epochs=cfg.eval.classifier_epochs, seed=cfg.seed)
    labels, samples = heldout_label_samples(gen, cfg, y_ho)
    n = len(labels)
    f_tr, f_ho, f_gen = (judge_features(judge, v) for v in (x_tr, x_ho, samples))
    fd_real = frechet_distance(f_tr, f_ho)
    fd_gen = frechet_distance(f_tr, f_gen)
    return {
        "judge_accuracy_real_heldout": judge_metrics(judge, x_ho, y_ho)["accuracy"],
        "sample_accuracy": judge_metrics(judge, samples, labels)["accuracy"],
        "fd_digits": fd_gen,
        "fd_digits_real": fd_real,
        "fd_digits_ratio": fd_gen / max(fd_real, 1e-12),
        "num_samples": n,
    }


def video_metrics(gen: Generator, cfg: DictConfig, heldout_ds: Any) -> Dict[str, Any]:
    """Temporal consistency of samples vs real held-out clips: mean absolute frame-to-frame
    difference (units of the [-1, 1] range; :func:`vitp.video_io.temporal_consistency`), for
    ``eval.num_samples`` samples (0 = one per held-out clip) with the held-out labels."""
    from .video_io import temporal_metrics

    x_ho, y_ho = _stack(heldout_ds)
    labels, samples = heldout_label_samples(gen, cfg, y_ho)
    return {**temporal_metrics(samples, x_ho), "num_samples": len(labels)}


def evaluate(gen: Generator, cfg: DictConfig, train_ds: Any, heldout_ds: Any, run_dir: Path, *, full: bool = True,
             step: Optional[int] = None, logger: Any = None) -> Dict[str, Any]:
    """Held-out loss (always) and, when ``full`` and the data are digits, the judge metrics.
    With ``full`` the results are written to ``run_dir/eval.json``."""
    res: Dict[str, Any] = {"step": step} if step is not None else {}
    if len(heldout_ds):
        res.update(heldout_loss(gen, cfg, heldout_ds))
    if full and cfg.data.name == "digits" and len(heldout_ds) > 1:
        res.update(digits_metrics(gen, cfg, train_ds, heldout_ds, run_dir))
        res["sampler"] = OmegaConf.to_container(cfg.sampler, resolve=True)
    if full and cfg.model.num_frames > 1 and len(heldout_ds):
        res.update(video_metrics(gen, cfg, heldout_ds))
        res["sampler"] = OmegaConf.to_container(cfg.sampler, resolve=True)
    if logger is not None and step is not None:
        logger.scalars(step, {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}, jsonl=False)
    if full:
        tmp = run_dir / "eval.json.tmp"
        tmp.write_text(json.dumps(res, indent=2) + "\n")
        os.replace(tmp, run_dir / "eval.json")
        log.info("eval: %s", {k: v for k, v in res.items() if isinstance(v, (int, float))})
    return res


def _last_step(run_dir: Path) -> Optional[int]:
    """The last logged training step of a run (from metrics.jsonl), if any."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else None


def load_run_config(run_dir: Path, overrides: list) -> DictConfig:
    """The run's composed config (``.hydra/config.yaml``) validated against the schema, with
    dotlist ``overrides`` applied. Raises ``FileNotFoundError`` naming the missing file."""
    from .config import Config

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a vitp run directory")
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    return cfg


def main(argv: Optional[list] = None) -> None:
    """Console entry point ``vitp-eval RUN_DIR [key=value ...]``; bad input exits with a
    one-line message (status 2)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        _eval_cli(argv)
    except (ValueError, FileNotFoundError, OmegaConfBaseException) as e:
        print(f"vitp-eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _eval_cli(argv: Optional[list] = None) -> None:
    from .data import build_datasets
    from .dist import resolve_device

    p = argparse.ArgumentParser(prog="vitp-eval", description="Evaluate a finished vitp run; rewrites eval.json.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--weights", default="model_ema.safetensors", help="weights file inside RUN_DIR")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. sampler.cfg_scale=2.0")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_run_config(a.run_dir, a.overrides)
    from .config import validate_config

    validate_config(cfg)
    path = a.run_dir / a.weights
    if not path.is_file() and a.weights == "model_ema.safetensors":  # an interrupted run: its latest checkpoint
        from .export import resolve_source

        path = resolve_source(a.run_dir, "ema")[0]
    gen, _ = load_weights(path, resolve_device(cfg.trainer.device))
    train_ds, heldout_ds = build_datasets(cfg.data, cfg.seed)
    res = evaluate(gen, cfg, train_ds, heldout_ds, a.run_dir, full=True, step=_last_step(a.run_dir))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
