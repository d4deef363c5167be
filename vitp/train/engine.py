"""The DeepSpeed engine of a run: its JSON config, optimizer parameter groups, and the start-up
check that every rank of a data-parallel replica sees the same batch."""
from __future__ import annotations

from typing import Any, Dict

import torch

from vitp.config import Layout
from vitp.parallel import distributed as dist


def deepspeed_config(cfg: Any, layout: Layout) -> Dict[str, Any]:
    """The DeepSpeed JSON config of the run (batch split over ``layout.dp``, ZeRO stage, precision,
    clipping, and the LR schedule as one of DeepSpeed's warmup schedulers)."""
    dp, precision = layout.dp, layout.precision
    o, tr = cfg.optim, cfg.trainer
    # DeepSpeed's linear warmup gives min + (1 - min) * k / n at step k; with min = 1/W and
    # n = W - 1 step k uses lr * (k + 1) / W, reaching the peak at step W - 1 (no lr=0 step).
    warmup = max(1, o.warmup_steps)
    n_warm = max(1, warmup - 1)
    if o.schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(tr.max_steps, n_warm + 1), "warmup_num_steps": n_warm,
            "warmup_min_ratio": 1.0 / warmup, "cos_min_ratio": o.min_lr_ratio, "warmup_type": "linear"}}
    else:  # constant (the schema allows no other value)
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_min_lr": o.lr / warmup, "warmup_max_lr": o.lr, "warmup_num_steps": n_warm, "warmup_type": "linear"}}
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
