"""The DeepSpeed engine of a run: its JSON config, the optimizer (and which ZeRO stage runs it),
the per-step gradient hook, and the start-up check that every rank of a data-parallel replica
sees the same batch.

ZeRO stage 1 partitions the optimizer state over the data-parallel ranks. With ``dp = 1`` in
fp32 it partitions nothing but still copies every gradient into flat buckets, all-reduces them
on a 1-rank group, steps AdamW on flat buffers and keeps a second fp32 copy of the weights; and
DeepSpeed's own stage-0 fp32 pipeline path reports no global grad norm and, with ``pp > 1``,
clips by a norm that leaves out the replicated parameters of the later stages (measured at
deepspeed 0.19.8; why :func:`vitp.config.validate_layout` refuses ``parallel.zero_stage=0`` in
fp32). So at ``dp = 1`` in fp32 the engine runs ZeRO stage 0 with :class:`ExactClipAdamW`,
torch's AdamW that clips by the exact global norm itself
(:func:`vitp.parallel.grads.global_grad_norm`; ``tests/distributed/test_pipeline.py`` checks the
grad norms of ``tp x pp`` runs against one process). bf16 keeps ZeRO-1 at any ``dp``: it needs
fp32 master weights (which ZeRO-1 keeps), and DeepSpeed's bf16 stage-0 path cannot resume
(``load_checkpoint`` fails with ``KeyError: 0`` at deepspeed 0.19.8).
"""
from __future__ import annotations

from typing import Any, Dict

import torch

import vitp.deepspeed_adapter as ds
from vitp.config import Layout
from vitp.parallel import distributed as dist
from vitp.parallel.grads import clip_grads_, global_grad_norm, sync_partial_grads


def zero_stage(cfg: Any, layout: Layout) -> int:
    """The ZeRO stage the engine runs: 0 for fp32 at ``dp = 1`` (module docstring), else
    ``parallel.zero_stage``."""
    return layout.engine_zero_stage(cfg.parallel.zero_stage)


class ExactClipAdamW(torch.optim.AdamW):
    """torch's AdamW whose :meth:`step` first computes the exact global grad norm over the
    model-parallel group, hands it to DeepSpeed's engine (which reports it,
    :func:`vitp.deepspeed_adapter.report_grad_norm`) and clips with DeepSpeed ZeRO's arithmetic. State dict = AdamW's.

    ``tp_rank`` and ``model_parallel_group`` say which parameters count on this rank (see
    :func:`vitp.parallel.grads.global_grad_norm`); ``max_norm = 0`` only measures.
    """

    def __init__(self, params, *, max_norm: float, tp_rank: int = 0, model_parallel_group=None, **adamw):
        super().__init__(params, **adamw)
        self.max_norm, self.tp_rank, self.model_parallel_group = max_norm, tp_rank, model_parallel_group
        ds.report_grad_norm(self, None)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        norm = global_grad_norm(params, self.tp_rank, self.model_parallel_group)
        ds.report_grad_norm(self, norm)
        clip_grads_(params, self.max_norm, norm)
        return super().step(closure)


def build_optimizer(module: torch.nn.Module, cfg: Any, layout: Layout, state: Any, grid: Any = None):
    """The run's AdamW: :class:`ExactClipAdamW` when :func:`zero_stage` is 0, else plain AdamW
    (ZeRO-1 wraps it and clips). ``grid``: DeepSpeed's ``PipelineParallelGrid`` (its
    model-parallel group); ``None`` for one process."""
    o = cfg.optim
    kw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    groups = param_groups(module, o.weight_decay)
    if zero_stage(cfg, layout) == 0:
        group = grid.get_model_parallel_group() if grid is not None else None
        return ExactClipAdamW(groups, max_norm=o.grad_clip, tp_rank=state.tp_rank, model_parallel_group=group, **kw)
    return torch.optim.AdamW(groups, **kw)


def install_step_hook(engine: Any, layout: Layout) -> None:
    """Before DeepSpeed's once-per-step gradient reduction (the pipeline's ``ReduceGrads``
    instruction, after the last micro-batch's backward), sum the TP-partial gradients
    (:func:`vitp.parallel.grads.sync_partial_grads`); skip DeepSpeed's reduction when it has
    nothing to do (ZeRO-0 at ``dp = 1``: it would copy every gradient into buckets and all-reduce
    them on a 1-rank group). Changes this engine only (:func:`vitp.deepspeed_adapter.patch_instruction`)."""
    skip_ds = layout.engine_dp == 1 and isinstance(engine.optimizer, ExactClipAdamW)

    def wrap(reduce):
        def reduce_grads(self):
            sync_partial_grads(self.module)
            if not skip_ds:
                reduce(self)
        return reduce_grads

    ds.patch_instruction(engine, "ReduceGrads", wrap)


def deepspeed_config(cfg: Any, layout: Layout) -> Dict[str, Any]:
    """The DeepSpeed JSON config of the run (batch split over ``layout.dp``; DeepSpeed's engine
    counts ``dp * cp`` data-parallel ranks, each cp rank seeing the same samples, so its
    "train batch" is the global batch times cp; ZeRO stage
    (:func:`zero_stage`), precision, clipping (by DeepSpeed, or 0 when :class:`ExactClipAdamW`
    clips), and the LR schedule as one of DeepSpeed's warmup schedulers)."""
    dp, precision = layout.dp, layout.precision
    o, tr = cfg.optim, cfg.trainer
    # DeepSpeed's linear warmup gives min + (1 - min) * k / n at step k; with min = 1/W and
    # n = W - 1 step k uses lr * (k + 1) / W, reaching the peak at step W - 1 (no lr=0 step).
    # DeepSpeed raises n below 2 to 2, so W = 2 takes its log warmup, log(k + 1) / log(2): 0, then 1.
    warmup = max(1, o.warmup_steps)
    n_warm = max(1, warmup - 1)
    kind = "log" if warmup == 2 else "linear"
    if o.schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(tr.max_steps, n_warm + 1), "warmup_num_steps": n_warm,
            "warmup_min_ratio": 1.0 / warmup, "cos_min_ratio": o.min_lr_ratio, "warmup_type": kind}}
    else:  # constant (the schema allows no other value)
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_min_lr": o.lr / warmup, "warmup_max_lr": o.lr, "warmup_num_steps": n_warm, "warmup_type": kind}}
    return {
        "train_batch_size": tr.global_batch_size * layout.cp,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": tr.global_batch_size // (tr.micro_batch_size * dp),
        "gradient_clipping": o.grad_clip if zero_stage(cfg, layout) else 0.0,
        "zero_optimization": {"stage": zero_stage(cfg, layout)},
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


def check_batch_consistency(batch, state: Any) -> None:
    """Fail loudly unless all ranks of a data-parallel replica (every TP rank, first and last
    pipeline stage) built the same first micro-batch: the data pipeline must depend on the data-parallel
    rank only.

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
