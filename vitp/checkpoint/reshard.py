"""Checkpoints of the earlier, full-tensor format, and the engine state every format shares.

Before sharded checkpoints (:mod:`.sharded`), every checkpoint held, besides DeepSpeed's own
per-rank files, full unsharded generator-keyed fp32 tensors written by rank 0:
``model.safetensors`` (the weights), ``model_ema.safetensors`` (the EMA) and
``optimizer.safetensors``: AdamW's ``exp_avg`` / ``exp_avg_sq`` and, in bf16, the fp32 master
weights, each under ``<kind>/<generator key>``, with AdamW's step count in the metadata.
:func:`load_resharded` still resumes them at any layout: every rank slices what its (stage, TP
shard) holds out of these and writes it into the optimizer through DeepSpeed's tensor-fragment
API (``safe_set_full_optimizer_state`` / ``safe_set_full_fp32_param``), or into torch's AdamW
state where the engine runs ZeRO stage 0 (fp32 at ``dp = 1``). The LR schedule and DeepSpeed's
step counters (:func:`engine_counters`) are in ``vitp_meta.json`` in both formats.
Sources: DeepSpeed universal checkpointing (Lian et al. 2024, arXiv:2406.18820;
``deepspeed/utils/tensor_fragment.py``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

import vitp.deepspeed_adapter as ds
from vitp.models import generator_key
from vitp.parallel import ParallelState, shard_like
from vitp.parallel import distributed as dist

log = logging.getLogger("vitp")

FILE = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_optimizer(engine: Any) -> Optional[Any]:
    """DeepSpeed's ZeRO / bf16 optimizer wrapper (parameters carry ``_hp_mapping``), its AdamW
    state linked to them (:func:`vitp.deepspeed_adapter.link_optimizer_state`), or ``None`` for a
    plain torch optimizer (ZeRO stage 0)."""
    return engine.optimizer if ds.link_optimizer_state(engine.optimizer) else None


def _torch_optimizer(engine: Any) -> Any:
    """The torch optimizer doing the update (inside DeepSpeed's ZeRO / bf16 wrapper, or itself)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _base_states(engine: Any) -> list:
    """The per-tensor state dicts of the torch optimizer doing the update (flat partitions under ZeRO)."""
    return list(_torch_optimizer(engine).state.values())


def adam_step(engine: Any) -> int:
    """AdamW's step count (the bias correction's ``t``), the same for every tensor.

    Raises ``ValueError`` when the optimizer's tensors disagree (a state no resharding can keep)."""
    steps = {int(s["step"]) for s in _base_states(engine) if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's tensors have different AdamW step counts {sorted(steps)}")
    return steps.pop() if steps else 0


def engine_counters(engine: Any) -> Dict[str, Any]:
    """The LR schedule's state and DeepSpeed's step counters, JSON-serialisable (``vitp_meta.json``)."""
    sched = engine.lr_scheduler
    return {"lr_scheduler": sched.state_dict() if sched is not None else None,
            "global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps),
            "lr": [float(g["lr"]) for g in engine.optimizer.param_groups]}


def _restore_counters(engine: Any, meta: Dict[str, Any]) -> None:
    """DeepSpeed's step counters and the LR schedule's position from ``meta``; the lr the next step
    trains at is this launch's schedule at that position (a resume with another ``optim.lr``,
    warmup, ``optim.min_lr_ratio`` or ``trainer.max_steps`` trains its first step with it; unchanged,
    it is the checkpoint's lr, bit for bit)."""
    c = meta["engine"]
    engine.global_steps, engine.global_samples = c["global_steps"], c["global_samples"]
    engine.skipped_steps = c["skipped_steps"]
    sched = engine.lr_scheduler
    if sched is not None and c["lr_scheduler"] is not None:
        sched.load_state_dict(c["lr_scheduler"])
        # the checkpoint's param-group lr is the old config's: step the schedule in place instead
        sched.step(sched.last_batch_iteration)
        return
    for g, lr in zip(engine.optimizer.param_groups, c["lr"]):  # the lr the next step trains at
        g["lr"] = lr


def _read(path: Path, keys: list) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: this checkpoint was written before vitp kept the optimizer in "
                                f"a layout-independent form, so it resumes only at its own layout (or export its "
                                f"weights and start a new run dir with trainer.init_from)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in keys if k in f.keys()}, meta
    except Exception as e:  # safetensors' own error types for truncated / corrupt files
        raise ValueError(f"checkpoint file {path} is corrupt or truncated: {e}") from e


def load_resharded(engine: Any, tag_dir: Path, meta: Dict[str, Any], state: ParallelState, depth: int) -> None:
    """Restore weights, fp32 master weights, AdamW moments and step, LR schedule and DeepSpeed's
    counters of this rank's (stage, TP shard) from a checkpoint's full tensors (any layout).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, damaged or
    lacks a tensor of this model."""
    ds.import_deepspeed()
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from .export import read_export

    named = list(engine.module.named_parameters())
    gen = {n: generator_key(n, depth) for n, _ in named}
    weights, _ = read_export(tag_dir / "model.safetensors", keys=list(gen.values()))
    path = tag_dir / FILE
    kinds = [*MOMENTS, "master"]
    full, fmeta = _read(path, [f"{k}/{g}" for k in kinds for g in gen.values()])
    zero = _zero_optimizer(engine)
    base = _torch_optimizer(engine)
    t = int(fmeta.get("adam_step", 0))
    with torch.no_grad():
        for name, p in named:
            key = gen[name]
            for kind in MOMENTS:
                if f"{kind}/{key}" not in full:
                    raise ValueError(f"{path} lacks {kind}/{key}: it was written for another model config")
            master = full.get(f"master/{key}", weights[key])
            p.copy_(shard_like(p, master.to(p.dtype), state))
            moments = {k: shard_like(p, full[f"{k}/{key}"], state).float() for k in MOMENTS}
            if zero is not None:
                safe_set_full_fp32_param(p, shard_like(p, master, state).float())
                for k, v in moments.items():
                    safe_set_full_optimizer_state(p, v, k)
            else:
                base.state[p] = {"step": torch.tensor(float(t)), **{k: v.clone() for k, v in moments.items()}}
    for s in _base_states(engine):
        if "step" in s:
            s["step"] = torch.tensor(float(t)) if torch.is_tensor(s["step"]) else t
    _restore_counters(engine, meta)


def rng_source_rank(meta: Dict[str, Any], state: ParallelState) -> Optional[int]:
    """The rank of the checkpoint's layout whose RNG streams this rank takes: the one at the same
    TP and context-parallel rank of the first stage and first replica (the model-parallel stream
    is seeded per TP rank), or ``None`` when the old layout had no such rank."""
    for r, (pp, dp, cp, tp) in enumerate(meta.get("rank_coords", [])):
        if (pp, dp, cp, tp) == (0, 0, state.cp_rank, state.tp_rank):
            return r
    return None


def describe_change(meta: Dict[str, Any], layout: Any) -> str:
    """``tp=2 pp=2 dp=2 -> tp=2 pp=2 dp=1`` for the log."""
    def fmt(d):
        return " ".join(f"{k}={d[k]}" for k in ("tp", "cp", "pp", "dp") if k != "cp" or d.get(k, 1) > 1)
    now = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp}
    old, new = meta.get("world_size", "?"), dist.world_size()
    return (f"{fmt({'cp': 1, **meta})} ({old} rank{'' if old == 1 else 's'}) -> {fmt(now)} "
            f"({new} rank{'' if new == 1 else 's'})")
