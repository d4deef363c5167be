"""``vitp-train``: train the ViT generator with DeepSpeed's pipeline engine and Hydra configs.

One path for every layout: config -> datasets -> ``PipelineModule`` -> ``deepspeed.initialize``
-> ``train_batch`` loop -> metrics.jsonl / TensorBoard / sample grids / checkpoints -> eval.json.

Launch (see README): ``vitp-train [overrides]``, ``torchrun --nproc_per_node N -m vitp.train``,
``deepspeed --num_gpus N --module vitp.train [overrides]``.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations checks PyPI at import otherwise
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would warn and probe for accelerators

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from . import dist  # noqa: E402
from .config import register_configs, validate_config  # noqa: E402

log = logging.getLogger("vitp")

T_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` on CPU; raises ``ValueError`` on unknown names."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"trainer.precision={precision!r}; use auto, fp32 or bf16")
    return precision


def resolve_layout(parallel: Any, world: int, precision: str = "fp32") -> Dict[str, int]:
    """``{"tp", "pp", "dp"}`` with ``dp = world / (tp * pp)``.

    Raises ``ValueError`` listing the valid (tp, pp) pairs when the layout is impossible.
    """
    tp, pp = parallel.tp, parallel.pp
    if tp < 1 or pp < 1 or world % (tp * pp):
        valid = [(t, p) for t in range(1, world + 1) for p in range(1, world + 1) if world % (t * p) == 0]
        raise ValueError(
            f"parallel.tp={tp} x parallel.pp={pp} does not divide world_size={world}; "
            f"valid (tp, pp) for {world} processes: {valid}"
        )
    if parallel.zero_stage not in (0, 1):
        raise ValueError(f"parallel.zero_stage={parallel.zero_stage}: pipelines support ZeRO stage 0 or 1")
    if parallel.zero_stage == 0 and precision == "fp32":
        # DeepSpeed's fp32 ZeRO-0 pipeline path reports no global grad norm (measured: None at pp=1
        # and pp=2) and its clipping norm drops replicated parameters of stages > 0.
        raise ValueError("parallel.zero_stage=0 in fp32: DeepSpeed's pipeline engine does not report, and with "
                         "pp > 1 miscomputes, the clipping grad norm; use parallel.zero_stage=1 (the default)")
    return {"tp": tp, "pp": pp, "dp": world // (tp * pp)}


def deepspeed_config(cfg: Any, dp: int, precision: str) -> Dict[str, Any]:
    """The DeepSpeed JSON config derived from the run config."""
    o, tr = cfg.optim, cfg.trainer
    # DeepSpeed's linear warmup gives min + (1 - min) * k / n at step k; with min = 1/W and
    # n = W - 1 step k uses lr * (k + 1) / W, reaching the peak at step W - 1 (no lr=0 step).
    warmup = max(1, o.warmup_steps)
    n_warm = max(1, warmup - 1)
    if o.schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(tr.max_steps, n_warm + 1), "warmup_num_steps": n_warm,
            "warmup_min_ratio": 1.0 / warmup, "cos_min_ratio": o.min_lr_ratio, "warmup_type": "linear"}}
    elif o.schedule == "constant":
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_min_lr": o.lr / warmup, "warmup_max_lr": o.lr, "warmup_num_steps": n_warm, "warmup_type": "linear"}}
    else:
        raise ValueError(f"optim.schedule={o.schedule!r}; use constant or cosine")
    return {
        "train_batch_size": tr.global_batch_size,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": tr.global_batch_size // (tr.micro_batch_size * dp),
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"},
        # DeepSpeed's partitioned sends handle one tensor that needs grad and assume identical
        # activations on TP ranks; stages exchange (tokens, c), both needing grad, and tokens
        # differ per TP rank under sequence parallelism: send them whole.
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        "scheduler": scheduler,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def param_groups(module: torch.nn.Module, weight_decay: float):
    """AdamW groups: decay matrices/convolutions, not biases, norms or embeddings' 1-D params."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, save a checkpoint, exit 0.

    Schedulers and SageMaker send SIGTERM before killing a job. A second signal aborts at once.
    :meth:`requested` is collective (one all-reduce), so every rank stops at the same step even
    when only some of them got the signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device):
        self.device, self.flag, self.previous = device, None, {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.flag is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.flag = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint", self.flag)

    def requested(self, local: bool = False) -> bool:
        """True on every rank when any rank got a signal or passes ``local=True``."""
        mine = self.flag is not None or local
        if dist.world_size() == 1:
            return mine
        t = torch.tensor([1.0 if mine else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


class RunLogger:
    """Rank-0 metrics: ``metrics.jsonl`` (one object per logged step) and TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard_dir: Optional[str] = None, start_step: int = 0):
        self.enabled = enabled
        self.tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed attempt logged after the checkpoint we resume from
            self.tb = SummaryWriter(tensorboard_dir or str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")

    def scalars(self, step: int, values: Dict[str, float], jsonl: bool = True) -> None:
        if not self.enabled:
            return
        for k, v in values.items():
            self.tb.add_scalar(k, v, step)
        if jsonl:
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()

    def image(self, tag: str, img: torch.Tensor, step: int) -> None:
        if self.enabled:
            self.tb.add_image(tag, img, step)

    def images(self, tag: str, imgs: torch.Tensor, step: int) -> None:
        """A batch ``(N, 3, H, W)`` in [0, 1] (video frame strips)."""
        if self.enabled:
            self.tb.add_images(tag, imgs, step)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


def binned_loss(t: torch.Tensor, loss: torch.Tensor) -> Dict[str, float]:
    """Mean loss per ``t`` bin over all ranks (ranks without records contribute zeros)."""
    n = len(T_BINS) - 1
    idx = torch.bucketize(t, torch.tensor(T_BINS[1:-1]), right=True)
    sums = torch.zeros(2, n, dtype=torch.float64)
    sums[0].index_add_(0, idx, loss.double())
    sums[1].index_add_(0, idx, torch.ones_like(loss, dtype=torch.float64))
    if dist.world_size() > 1:
        torch.distributed.all_reduce(sums)
    return {
        f"loss_t/{T_BINS[i]:.1f}-{T_BINS[i + 1]:.1f}": (sums[0, i] / sums[1, i]).item()
        for i in range(n) if sums[1, i] > 0
    }


def check_batch_consistency(batch, state: Any) -> None:
    """Fail loudly unless all ranks of a data-parallel replica (every TP rank, first and last
    pipeline stage) built the same first micro-batch (design invariant 7).

    Raises ``RuntimeError`` on every rank when checksums disagree.
    """
    if dist.world_size() == 1:
        return
    inputs, targets = batch
    local = [round(float(t.double().sum()), 6) for t in (*inputs, *targets)]
    table = [None] * dist.world_size()
    torch.distributed.all_gather_object(table, (state.dp_rank, local))
    bad = sorted({r for r, (d, c) in enumerate(table) if c != next(c2 for d2, c2 in table if d2 == d)})
    if bad:
        raise RuntimeError(
            f"data mismatch inside a data-parallel replica (ranks {bad}): the first micro-batch differs between "
            f"TP ranks or pipeline stages; the data pipeline must depend on the data-parallel rank only"
        )


def log_stages(module: torch.nn.Module, state: Any, device: torch.device, run_dir: Path) -> None:
    """Gather per-rank (stage, tp rank) parameter counts and peak memory; rank 0 logs them and
    writes ``stages.json``."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB -> MiB (process RSS)
    row = {"rank": dist.rank(), "stage": state.pp_rank, "tp_rank": state.tp_rank, "dp_rank": state.dp_rank,
           "parameters": sum(p.numel() for p in module.parameters()), "peak_memory_mib": round(peak, 1)}
    rows = [row]
    if dist.world_size() > 1:
        rows = [None] * dist.world_size()
        torch.distributed.all_gather_object(rows, row)
    if dist.is_main():
        for r in rows:
            if r["dp_rank"] == 0:
                log.info("stage %d tp %d: %.3fM parameters, peak memory %.0f MiB", r["stage"], r["tp_rank"],
                         r["parameters"] / 1e6, r["peak_memory_mib"])
        (run_dir / "stages.json").write_text(json.dumps(rows, indent=1) + "\n")


def train(cfg: DictConfig, run_dir: str | os.PathLike, overrides: Optional[list] = None) -> Dict[str, Any]:
    """Train with the composed config ``cfg``, writing everything under ``run_dir``.

    Once every check has passed, rank 0 writes ``run_dir/.hydra/config.yaml`` (and
    ``overrides.yaml`` from ``overrides``), so a refused launch leaves a run directory untouched.

    Returns a summary dict (``losses``, ``grad_norms`` per step on every rank, and the final
    ``eval`` results on rank 0). Raises ``ValueError`` on an invalid layout/config before any
    training step; raises ``FloatingPointError`` if the loss becomes NaN/inf.
    """
    import deepspeed
    from tqdm import tqdm

    from . import checkpoint as ckpt
    from .data import build_datasets
    from .data.loader import BatchSchedule, train_loader
    from .evaluate import evaluate, generator_from_state, save_weights, write_sample_grid
    from .models import num_tokens, validate_model_config
    from .objectives import FlowMatchingLoss
    from .parallel import from_grid, full_weight, model_parallel_seed, shard_like, tensor_parallelize, validate_tp
    from .pipeline import EMA, build_pipeline, stage_blocks, to_generator_state

    for name in ("DeepSpeed", "compilers"):  # DeepSpeed's op probe logs compiler commands
        logging.getLogger(name).setLevel(logging.WARNING)
    run_dir = Path(run_dir)
    validate_config(cfg)
    validate_model_config(cfg.model)
    tr = cfg.trainer
    ckpt_dir = run_dir / "checkpoints"
    resume_tag = ckpt.find_checkpoint(str(tr.resume), ckpt_dir)
    if resume_tag is None and (run_dir / "metrics.jsonl").exists() and tr.resume == "never":
        raise ValueError(f"{run_dir} already holds a run (metrics.jsonl) and trainer.resume=never; choose a new "
                         f"hydra.run.dir, or use trainer.resume=auto to continue it")
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        log.warning("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    device = dist.resolve_device(cfg.trainer.device)
    precision = resolve_precision(cfg.trainer.precision, device)
    layout = resolve_layout(cfg.parallel, dist.world_size(), precision)
    validate_tp(cfg.model, layout["tp"])
    stage_blocks(cfg.model.depth, layout["pp"])
    resume_meta = None
    if resume_tag is not None:
        resume_meta = ckpt.verify_checkpoint(resume_tag)
        ckpt.check_resumable(resume_meta, resume_tag, cfg, layout, precision)
    start_step = resume_meta["step"] if resume_meta else 0
    if resume_meta and resume_meta.get("max_steps") not in (None, tr.max_steps):
        log.warning("trainer.max_steps=%d differs from the checkpoint's run (%d): the LR schedule after step %d "
                    "changes accordingly", tr.max_steps, resume_meta["max_steps"], start_step)
    dist.init_distributed(device)
    main = dist.is_main()  # rank 0 writes everything
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob("*.partial") if ckpt_dir.is_dir() else []:
            log.warning("removing %s: a checkpoint whose save never finished", stale)
            shutil.rmtree(stale)
        for name in ("metrics.jsonl", "eval.jsonl"):
            dropped = ckpt.truncate_log(run_dir / name, start_step)
            if dropped:
                log.warning("%s: dropped %d lines logged after step %d (resuming from there)", name, dropped, start_step)

    train_ds, heldout_ds = build_datasets(cfg.data, cfg.seed)
    schedule = BatchSchedule(len(train_ds), cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size,
                             layout["dp"], cfg.seed)
    loss_fn = FlowMatchingLoss(cfg.objective.t_eps)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its layer table on rank 0
        module = build_pipeline(cfg.model, loss_fn, seed=cfg.seed, **layout,
                                activation_checkpoint_interval=cfg.parallel.activation_checkpoint_interval)
    state = from_grid(module._grid, cfg.parallel.sequence_parallel)
    tensor_parallelize(module, state, seq_len=num_tokens(cfg.model))
    if resume_tag is None and (tr.init_from or tr.init_from_timm):
        init_weights(module, cfg, state)
    model_parallel_seed(cfg.seed, state)
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(module, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    ds_log = logging.getLogger("DeepSpeed")
    ds_log.setLevel(logging.ERROR)  # "lr before the scheduler started" warnings during set-up
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config=deepspeed_config(cfg, layout["dp"], precision))
    ds_log.setLevel(logging.WARNING)
    # DeepSpeed's warmup schedulers hold lr = 0 until their first step(); advance once so that
    # the first optimizer step trains at lr / warmup_steps.
    engine.lr_scheduler.step()
    ema = EMA(engine.module, o.ema_decay)
    if resume_tag is not None:
        ckpt.load_training_checkpoint(engine, resume_tag, dist.rank())
        params = dict(engine.module.named_parameters())
        keys = {n: ckpt.gen_key(n, cfg.model.depth) for n in params}
        ema_full, _ = ckpt.read_export(resume_tag / "model_ema.safetensors", keys=keys.values())  # this stage only
        with torch.no_grad():
            for n, p in params.items():
                ema.params[n].copy_(shard_like(p, ema_full[keys[n]], state))
        ema.updates = resume_meta["ema_updates"]
        del ema_full

    if main:  # every check has passed (layout, resume, init files)
        write_run_config(run_dir, cfg, overrides)
    logger = RunLogger(run_dir, main, tr.tensorboard_dir, start_step)
    if main:
        skipped = getattr(getattr(train_ds, "base", None), "num_skipped", 0)
        log.info("run dir %s | layout tp=%d pp=%d dp=%d | %s on %s | %d tokens per sample | %d train / %d held-out%s",
                 run_dir, layout["tp"], layout["pp"], layout["dp"], precision, device, num_tokens(cfg.model),
                 len(train_ds), len(heldout_ds), f" | {skipped} unreadable files skipped" if skipped else "")
        if resume_tag is not None:
            log.info("resumed from %s (step %d of %d)", resume_tag, start_step, tr.max_steps)

    data_iter = None
    if start_step < tr.max_steps:
        loader_args = (train_ds, schedule, cfg.objective, cfg.model.num_classes)
        batches = iter(train_loader(*loader_args, start_step=start_step, stop_step=tr.max_steps,
                                    dp_rank=state.dp_rank, num_workers=cfg.data.num_workers))
        first = next(batches)
        check_batch_consistency(first, state)
        data_iter = itertools.chain([first], batches)

    def full_state(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        # collective (TP gather, then stages to rank 0): every rank calls it, rank 0 gets the result
        named = dict(engine.module.named_parameters())
        local = {n: full_weight(named[n], state, tensor=v).cpu() for n, v in params.items()}
        if state.pp_size > 1:
            parts = [None] * dist.world_size() if main else None
            send = local if state.tp_rank == 0 and state.dp_rank == 0 else {}
            torch.distributed.gather_object(send, parts, dst=0)
            local = {k: v for part in (parts or []) for k, v in part.items()}
        return to_generator_state(local, cfg.model.depth) if main else {}

    def ema_generator():
        full = full_state(ema.state_dict())
        return generator_from_state(cfg.model, full, device) if main else None

    def sample_grid(step: int) -> None:
        gen = ema_generator()
        if main:
            out = write_sample_grid(gen, cfg, run_dir / "samples" / f"step_{step:07d}.png")
            logger.image("samples", out["grid"], step)
            if out["strips"] is not None:
                logger.images("samples/frames", out["strips"], step)

    def heldout_eval(step: int, final: bool) -> Dict[str, Any]:
        gen = ema_generator()
        if not main:
            return {}
        res = evaluate(gen, cfg, train_ds, heldout_ds, run_dir, full=final, step=step, logger=logger)
        if not final and "heldout_loss" in res:
            bar.write(f"step {step}: held-out loss {res['heldout_loss']:.4f}")
        with open(run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float))}) + "\n")
        return res

    def full_states():
        return full_state(ema.state_dict()), full_state({n: p.detach() for n, p in engine.module.named_parameters()})

    def save(step: int):
        meta = {"tp": layout["tp"], "pp": layout["pp"], "dp": layout["dp"], "precision": precision,
                "zero_stage": cfg.parallel.zero_stage, "model": OmegaConf.to_container(cfg.model, resolve=True),
                "ema_updates": ema.updates, "seed": cfg.seed, "global_batch_size": tr.global_batch_size,
                "max_steps": tr.max_steps}
        return ckpt.save_training_checkpoint(engine, ckpt_dir, step, rank=dist.rank(), main=main, meta=meta,
                                             full_states=full_states, cfg=cfg, keep=tr.keep_checkpoints)

    losses, norms = [], []
    bar = tqdm(total=tr.max_steps, initial=start_step, disable=not (main and tr.progress), desc="train",
               dynamic_ncols=True)
    if tr.eval_every and start_step == 0:
        heldout_eval(0, final=False)  # the untrained model's held-out loss, for reference
    t_log, n_log = time.perf_counter(), 0
    result: Dict[str, Any] = {}
    stopper = StopSignal(device)
    t_start = time.perf_counter()
    stopped_at = None
    try:
        for step in range(start_step + 1, tr.max_steps + 1):  # step = optimizer steps completed
            lr = engine.get_lr()[0]  # the lr this step uses
            loss = engine.train_batch(data_iter=data_iter).item()
            ema.update(engine.module)
            norm = engine.get_global_grad_norm()
            losses.append(loss)
            norms.append(float(norm) if norm is not None else float("nan"))
            n_log += 1
            if not math.isfinite(loss):
                hint = "" if precision == "fp32" else ", or use trainer.precision=fp32"
                raise FloatingPointError(f"loss is {loss} at step {step}: lower optim.lr or keep optim.grad_clip > 0{hint}")
            last = step == tr.max_steps
            if step % tr.log_every == 0 or last or step == 1:
                values = {"loss": sum(losses[-n_log:]) / n_log, "grad_norm": sum(norms[-n_log:]) / n_log,
                          "lr": lr, "samples_per_s": n_log * tr.global_batch_size / (time.perf_counter() - t_log)}
                values.update(binned_loss(*loss_fn.pop_records()))
                logger.scalars(step, values)
                bar.set_postfix(loss=f"{values['loss']:.4f}", gnorm=f"{values['grad_norm']:.3f}")
                t_log, n_log = time.perf_counter(), 0
            bar.update(1)
            if step == start_step + 1:
                log_stages(engine.module, state, device, run_dir)
            timed_out = tr.exit_after_minutes is not None and time.perf_counter() - t_start > 60 * tr.exit_after_minutes
            if stopper.requested(local=step == tr.exit_at_step or timed_out) and not last:
                stopped_at = step
                break
            if not last and tr.sample_every and step % tr.sample_every == 0:
                sample_grid(step)
            if not last and tr.eval_every and step % tr.eval_every == 0:
                heldout_eval(step, final=False)
            if not last and tr.checkpoint_every and step % tr.checkpoint_every == 0:
                save(step)
    finally:
        stopper.restore()
        bar.close()

    if stopped_at is not None:
        save(stopped_at)
        logger.close()
        if main:
            why = stopper.flag or ("trainer.exit_at_step" if stopped_at == tr.exit_at_step else "trainer.exit_after_minutes"
                                   if tr.exit_after_minutes is not None else "a signal on another rank")
            log.warning("stopped by %s after step %d; checkpoint %s saved. Run the same command again "
                        "(trainer.resume=auto) to continue", why, stopped_at,
                        ckpt_dir / ckpt.tag_name(stopped_at))
        return {"losses": losses, "grad_norms": norms, "eval": {}, "run_dir": str(run_dir), "stopped_at": stopped_at}
    if ckpt.tag_name(tr.max_steps) in ckpt.published_tags(ckpt_dir):  # resumed a finished run
        saved = full_states()  # collective; rank 0 gets the weights
    else:
        saved = save(tr.max_steps)
    if main:
        save_weights(run_dir, cfg, *saved, step=tr.max_steps)
    sample_grid(tr.max_steps)
    if cfg.eval.enabled:
        result = heldout_eval(tr.max_steps, final=True)
    logger.close()
    if main:
        log.info("done: %s holds model_ema.safetensors, samples/, metrics.jsonl%s%s", run_dir,
                 ", eval.json" if cfg.eval.enabled else "", "" if tr.tensorboard_dir else ", tb/")
    if main and tr.export_dir:
        export = Path(tr.export_dir)
        export.mkdir(parents=True, exist_ok=True)
        for name in ("model_ema.safetensors", "model_ema.json", "model.safetensors", "model.json", "eval.json"):
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, export / name)
    if dist.world_size() > 1:
        torch.distributed.barrier()
    return {"losses": losses, "grad_norms": norms, "eval": result, "run_dir": str(run_dir), "stopped_at": None}


def write_run_config(run_dir: Path, cfg: DictConfig, overrides: Optional[list]) -> None:
    """``.hydra/config.yaml`` (what ``vitp-eval`` reloads) and ``overrides.yaml``, atomically."""
    folder = run_dir / ".hydra"
    folder.mkdir(exist_ok=True)
    files = {"config.yaml": OmegaConf.to_yaml(cfg)}
    if overrides is not None:
        files["overrides.yaml"] = OmegaConf.to_yaml(OmegaConf.create(list(overrides)))
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)


def init_weights(module: torch.nn.Module, cfg: DictConfig, state: Any) -> None:
    """Initialise this rank's pipeline shard from ``trainer.init_from`` (an exported vitp file: all
    weights, any layout) or ``trainer.init_from_timm`` (a timm ViT state dict: the blocks), logging
    what was loaded. Raises ``ValueError`` / ``FileNotFoundError`` naming the file and the problem."""
    from . import checkpoint as ckpt
    from .models import Generator

    tr, depth = cfg.trainer, cfg.model.depth
    if tr.init_from:
        full, meta = ckpt.read_export(tr.init_from)
        file_model = json.loads(meta.get("vitp_model") or json.dumps(json.loads(meta["vitp_config"])["model"]))
        ckpt.check_model_matches(file_model, cfg.model, ckpt.ARCH_KEYS, tr.init_from,
                                 "set those model.* keys to the file's values (see its .json sidecar)")
        ckpt.load_full_into_pipeline(module, full, state, depth, source=tr.init_from, strict=True)
        if dist.is_main():
            log.info("initialised all %d tensors from %s (step %s, %s weights)", len(full), tr.init_from,
                     meta.get("step", "?"), meta.get("weights", "?"))
        return
    timm_sd = ckpt.load_timm_state(tr.init_from_timm)
    blocks, unused = ckpt.timm_block_state(timm_sd, depth, tr.init_from_timm)
    timm_depth = 1 + max(int(m.group(1)) for k in timm_sd if (m := re.match(r"^blocks\.(\d+)\.", k)))
    if timm_depth != depth and dist.is_main():
        log.warning("init_from_timm: %s has %d blocks, the model %d: %s", tr.init_from_timm, timm_depth, depth,
                    f"its blocks {depth}..{timm_depth - 1} are ignored" if timm_depth > depth
                    else f"model blocks {timm_depth}..{depth - 1} keep their initialisation")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Generator(OmegaConf.to_container(cfg.model, resolve=True)).state_dict().items()}
    unexpected = unused + [k for k in blocks if k not in expected]
    loaded = {k: v for k, v in blocks.items() if k in expected}
    for k in expected:  # in model order, so the first mismatch is reported
        if k in loaded and tuple(loaded[k].shape) != expected[k]:
            raise ValueError(f"{tr.init_from_timm}: {k} has shape {tuple(loaded[k].shape)} but the model expects {expected[k]}")
    if not loaded:
        raise ValueError(f"{tr.init_from_timm}: no tensor matches a generator block parameter; check model.width/depth")
    ckpt.load_full_into_pipeline(module, loaded, state, depth, source=tr.init_from_timm, strict=False)
    if dist.is_main():
        missing = [k for k in expected if k not in loaded]
        log.info("init_from_timm %s: loaded %d tensors (%s ...); missing, kept at initialisation: %d (%s ...); "
                 "unexpected, ignored: %d (%s ...)", tr.init_from_timm, len(loaded), ", ".join(list(loaded)[:3]),
                 len(missing), ", ".join(missing[:3]), len(unexpected), ", ".join(unexpected[:3]))


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()

    @hydra.main(version_base="1.3", config_path=_config_path(), config_name="config")
    def _main(cfg: DictConfig) -> None:
        try:
            hc = HydraConfig.get()  # returns normally after a SIGTERM save: exit 0
            train(cfg, hc.runtime.output_dir, overrides=list(hc.overrides.task))
        except (ValueError, FileNotFoundError, FloatingPointError) as e:  # bad input: message, no traceback
            log.error("vitp-train: %s: %s", type(e).__name__, e)
            sys.exit(2)

    _main()


def _config_path() -> str:
    """Absolute path of the shipped ``conf/`` folder (installed as the ``vitp.conf`` package)."""
    import importlib.resources

    return str(importlib.resources.files("vitp.conf"))


def prepare_argv(argv: list) -> list:
    """Launcher-independent argv for Hydra.

    Strips ``--local_rank``; under a multi-process launcher it initialises the process group,
    pins one run directory for all ranks (chosen on rank 0) and keeps non-zero ranks from
    writing ``.hydra/`` and log files.
    """
    argv = dist.strip_launcher_args(argv)
    if not any(a.startswith("hydra.output_subdir=") for a in argv):
        argv.append("hydra.output_subdir=null")  # train() writes .hydra/ itself, after its checks pass
    if dist.world_size() > 1:
        device_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("trainer.device=")), "auto")
        dist.init_distributed(dist.resolve_device(device_arg))
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            root = next((a.split("=", 1)[1] for a in argv if a.startswith("paths.output_root=")), "outputs")
            argv.append(f"hydra.run.dir={dist.default_run_dir(root)}")
        if not dist.is_main():
            argv += ["hydra/job_logging=stdout"]
    return argv


def main() -> None:
    """Console entry point ``vitp-train``."""
    sys.argv = prepare_argv(sys.argv)
    _hydra_entry()


if __name__ == "__main__":
    main()
