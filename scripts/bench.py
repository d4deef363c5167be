#!/usr/bin/env python
"""vitp's performance suite: one command, a JSON file and a Markdown table.

    python scripts/bench.py [--quick] [--out bench] [--reps 7] [--sections overhead,tp,...] [--load N]

Every timing compares variants *interleaved* in one process group (A, B, A, B, ... after warm-up
steps), so load from other processes on the machine hits all variants alike; it reports the
median over repetitions of the per-repetition ratio of median step times, and the spread
(min - max of those ratios). All variants train the same model on the same micro-batches
(fp32, CPU, gloo, one thread per process) and their first-step losses are reported side by side.
The 1-minute load average is sampled during every section and reported with it; ``--load N``
adds ``N`` busy-loop processes for the whole run, a controlled load to time under.

Sections (``--sections``, default all; ``--quick`` leaves ``compile`` out unless named):

- ``overhead`` (1 process): ``engine.train_batch`` of vitp against a plain PyTorch loop
  (the same :class:`vitp.models.Generator`, ``torch.optim.AdamW``, ``clip_grad_norm_``), at the
  demo size and a larger one; steady model-state bytes (every live tensor after a step).
- ``tp`` (2 processes): vitp tp=2 against torch's DTensor TP (``parallelize_module`` with
  ``ColwiseParallel`` on qkv/fc1 and ``RowwiseParallel`` on proj/fc2 of the same blocks), and
  vitp tp=2 with sequence parallelism against plain tp=2; collectives per step (count, bytes)
  against the Megatron / Korthikanti et al. 2022 theory per collective.
- ``memory`` (4 processes, tp=2 x pp=2): parameter, gradient and optimizer bytes per rank
  against ``total / (tp * pp)``.
- ``activations`` (2 processes): bytes saved for backward by one block (saved-tensor hooks,
  parameters excluded) at tp=1, tp=2 and tp=2 + SP, against Korthikanti et al. 2022 (Eq. 2-4).
- ``pipeline`` (2 then 3 processes, pp=2 and pp=3; ``--quick``: pp=2): step time of one global
  batch split into ``m`` micro-batches against one process running the same batch; bubble
  ``1 - T_1 / (p T_m)`` against the 1F1B theory ``(p - 1) / (m + p - 1)``; per stage the idle
  time the pipeline timeline measures against 1F1B with the stages' measured compute; the CPU
  time per step over the cores (where ranks outnumber cores the step cannot be shorter).
- ``tokens`` (1 process): vitp and the plain loop as the token count grows.
- ``compile`` (1 then 2 processes): ``trainer.compile=blocks`` against eager (1 process, tp=2 +
  SP), interleaved: the training step and the sampler's forward (no grad) at each size, the
  compile time of the first training step and of the first sampler forward, graphs and graph
  breaks; ``compile.ratio_1proc`` / ``compile.ratio_tp2`` are the training-step ratios at the
  largest size.
- ``cp`` (4 then 2 processes; context parallelism, :mod:`vitp.parallel.context`; ``--sections cp``
  alone takes ~1-3 minutes): on a video generator of 4096 tokens (``--quick``: 64), per rank at
  cp = 1, 2, 4 for full attention (Ulysses, ring) and factorized attention (a) the bytes saved
  for backward by one training micro-batch forward, whole and without what every cp rank holds
  at full size, against ``1 / cp``; (b) the cp collectives of forward + backward (CommRecorder,
  tags ``cp`` and ``cp_boundary``) against :func:`vitp.parallel.styles.context_collectives` per
  block plus the gather of the prediction; (c) one attention layer at cp = 2, vitp's Ulysses
  against DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` and vitp's ring against
  its Ulysses (interleaved), with the outputs' max abs difference.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ----------------------------------------------------------------------------- sizes

BASE = ["data=synthetic", "eval.enabled=false", "trainer.eval_every=0", "trainer.sample_every=0",
        "trainer.checkpoint_every=0", "trainer.log_every=1000000", "trainer.progress=false",
        "trainer.precision=fp32", "trainer.max_steps=1000000", "optim.warmup_steps=1", "optim.schedule=constant"]
SIZES = {
    # the digits demo model (ModelConfig defaults: width 128, depth 6, 4 heads), 8x8 grey, 16 tokens
    "demo": ["data.channels=1", "data.resolution=8", "data.num_classes=10", "trainer.global_batch_size=64",
             "trainer.micro_batch_size=64"],
    # width 384, depth 6, 6 heads, 32x32 RGB with patch 2: 256 tokens
    "large": ["model.width=384", "model.num_heads=6", "data.channels=3", "data.resolution=32",
              "data.num_classes=10", "trainer.global_batch_size=16", "trainer.micro_batch_size=16"],
    # --quick: tiny sizes for the smoke test
    "tiny": ["model=tiny", "data.channels=1", "data.resolution=8", "data.num_classes=10",
             "trainer.global_batch_size=4", "trainer.micro_batch_size=4"],
}


def compose(size: str, extra=()):
    from vitp.config import compose as _compose

    return _compose([*BASE, *SIZES[size], *extra])


# ----------------------------------------------------------------------------- process groups

def _without_rank(rank, fn, *args):
    return fn(*args)


def run_group(world: int, fn, *args, timeout: float = 1800):
    """``fn(*args)`` on ``world`` fresh ranks of one gloo group; rank 0's result."""
    from vitp.parallel.local_group import run_local_group

    return run_local_group(world, _without_rank, fn, *args, timeout=timeout)[0]


# ----------------------------------------------------------------------------- variants

class Variant:
    """A named training step ``step() -> loss`` and its first-step loss."""

    def __init__(self, name, step):
        self.name, self.step, self.first_loss = name, step, None


def vitp_variant(name, cfg, run_dir):
    """vitp's own step (``engine.train_batch`` of the :class:`vitp.train.Trainer`'s engine) on
    the first step's micro-batches, repeated; returns ``(Variant, trainer, micro-batches)``."""
    import uuid

    from vitp.train import Trainer

    tr = Trainer(cfg, f"{run_dir}-{uuid.uuid4().hex[:8]}")  # a fresh run dir per variant
    gas = tr.engine.gradient_accumulation_steps()
    micro = [next(tr.data_iter) for _ in range(gas)]
    data = itertools.cycle(micro)
    return Variant(name, lambda: float(tr.engine.train_batch(data_iter=data))), tr, micro


def plain_variant(name, cfg, micro, model=None, clip_norm=None):
    """A plain PyTorch loop: ``model`` (default: the :class:`Generator` of ``cfg`` with the
    pipeline's per-layer seeds), AdamW with vitp's parameter groups, gradient accumulation over
    ``micro``, ``clip_grad_norm_`` (or ``clip_norm(params, max)``), ``step``."""
    import torch

    from vitp.models import Generator
    from vitp.objectives import FlowMatchingLoss
    from vitp.train.engine import param_groups

    model = model or Generator.from_config(cfg.model, seed=cfg.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    loss_fn, params = FlowMatchingLoss(cfg.objective.t_eps), [p for p in model.parameters()]
    clip = clip_norm or (lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m))

    def step():
        total = 0.0
        for inputs, targets in micro:
            loss = loss_fn(model(*inputs), targets) / len(micro)
            loss.backward()
            total += float(loss.detach())
        clip(params, o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return Variant(name, step), model, opt


def interleave(variants, reps: int, steps: int, warmup: int = 2):
    """Run ``warmup`` steps of each, then ``reps`` repetitions of ``steps`` steps of each variant
    in turn (order rotated every repetition). Returns ``{name: [median step seconds per rep]}``."""
    import torch.distributed as tdist

    for v in variants:
        for i in range(warmup):
            loss = v.step()
            v.first_loss = loss if i == 0 else v.first_loss
    out = {v.name: [] for v in variants}
    for r in range(reps):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times = []
            for _ in range(steps):
                if tdist.is_initialized() and tdist.get_world_size() > 1:
                    tdist.barrier()
                t0 = time.perf_counter()
                v.step()
                times.append(time.perf_counter() - t0)
            out[v.name].append(statistics.median(times))
    return out


def ratio(times, a: str, b: str) -> dict:
    """Median (and min, max) over repetitions of ``median_a / median_b``; median step times in ms."""
    rs = [x / y for x, y in zip(times[a], times[b])]
    return {"ratio": round(statistics.median(rs), 4), "min": round(min(rs), 4), "max": round(max(rs), 4),
            f"{a}_ms": round(1e3 * statistics.median(times[a]), 2), f"{b}_ms": round(1e3 * statistics.median(times[b]), 2),
            "reps": len(rs)}


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (``gc``)."""
    import torch

    import warnings

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        try:
            if not obj.is_meta:
                st = obj.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
        except Exception:  # noqa: BLE001 - objects half torn down by gc
            continue
    return total


# ----------------------------------------------------------------------------- overhead / tokens

def overhead_worker(size: str, reps: int, steps: int, tmp: str, extra=()) -> dict:
    """vitp vs the plain loop at one size (1 process); model-state bytes of each."""
    cfg = compose(size, extra)
    base = live_tensor_bytes()
    vitp, tr, micro = vitp_variant("vitp", cfg, f"{tmp}/overhead-{size}-{len(extra)}")
    vitp.step()
    ema = sum(t.numel() * t.element_size() for t in tr.ema.params.values())  # the trainer's, not the step's
    vitp_bytes = live_tensor_bytes() - base - ema - sum(t.numel() * t.element_size() for mb in micro for x in mb
                                                        for t in x)
    before = live_tensor_bytes()
    plain, model, _ = plain_variant("plain", cfg, micro)
    plain.step()
    plain_bytes = live_tensor_bytes() - before
    times = interleave([vitp, plain], reps, steps)
    from vitp.models import num_tokens

    return {**ratio(times, "vitp", "plain"), "first_loss": {"vitp": vitp.first_loss, "plain": plain.first_loss},
            "tokens": num_tokens(**cfg.model), "batch": cfg.trainer.global_batch_size,
            "model_state_bytes": {"vitp": vitp_bytes, "plain": plain_bytes,
                                  "ratio": round(vitp_bytes / plain_bytes, 4)}}


def tokens_worker(size: str, resolutions, reps: int, steps: int, tmp: str) -> dict:
    """Step time of vitp and the plain loop as the token count grows (1 process)."""
    out = {}
    for res in resolutions:
        r = overhead_worker(size, reps, steps, tmp, extra=[f"data.resolution={res}"])
        out[str(r["tokens"])] = {k: r[k] for k in ("ratio", "min", "max", "vitp_ms", "plain_ms")}
    return out


# ----------------------------------------------------------------------------- tensor parallel

def dtensor_parallelize(model, tp: int):
    """torch's own TP on the generator's blocks (``parallelize_module``): qkv and fc1
    ``ColwiseParallel``, proj and fc2 ``RowwiseParallel``; everything else stays replicated.
    qkv's rows are permuted first so that the contiguous column split is the head-wise one
    (timm's ``Attention`` packs ``[Q | K | V]``; :func:`vitp.parallel.shard_tensor` with stride 3
    takes the same head-wise slice), and each attention runs ``H / tp`` heads."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,))
    for blk in model.blocks:
        a = blk.attn
        H, hd = a.num_heads, a.head_dim
        with torch.no_grad():
            for p in (a.qkv.weight, a.qkv.bias):
                if p is not None:
                    p.copy_(p.view(3, tp, H // tp, hd, -1).transpose(0, 1).reshape(p.shape))
        a.num_heads, a.attn_dim = H // tp, a.attn_dim // tp
        parallelize_module(blk, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                       "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return model


def dtensor_clip(params, max_norm: float):
    """Exact global grad norm of a model mixing DTensor (sharded) and plain (replicated)
    parameters, then clipping, as torchtitan's ``clip_grad_norm_`` does for DTensors."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sq = sum((g.to_local() if isinstance(g, DTensor) else g).double().pow(2).sum() for g in grads
             if not isinstance(g, DTensor))
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    part = torch.stack([g.double().pow(2).sum() for g in sharded]).sum() if sharded else torch.zeros((), dtype=torch.float64)
    torch.distributed.all_reduce(part)
    norm = float((sq + part).sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def comm_theory(cfg, tp: int, sp: bool, regather: bool, partial_bytes: int) -> dict:
    """Collectives per optimizer step of the block linears and the SP boundary:
    ``{"kind/direction/tag": {"count", "bytes"}}`` (logical tensor bytes, fp32).

    Shoeybi et al. 2019: per block and micro-batch 2 all-reduces of ``B N D`` forward and 2
    backward. Korthikanti et al. 2022 §4.2.2: with SP each becomes an all-gather plus a
    reduce-scatter of the same tensor; Megatron-LM re-gathers the column-parallel inputs in
    backward instead of saving them (``regather``: 2 more all-gathers per block backward). SP
    boundary per micro-batch: the gather before the final layer, and the gradient gather of the
    token split after the embedding. Replicated parameters whose gradient is a per-rank partial
    sum: one all-reduce of ``partial_bytes`` per step. The adaLN modulation (sharded) adds one
    all-gather of ``(B, 6D)`` per block and one of ``(B, 2D)`` for the final layer in forward,
    under SP the blocks' reduce-scatters in backward, and the conditioning's gradient one
    all-reduce of ``(B, D)`` per micro-batch where it leaves the embedding.
    """
    from vitp.models import num_tokens

    m, L, D = cfg.model, cfg.model.depth, cfg.model.width
    B, n_micro = cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size
    n_pad = -(-num_tokens(**m) // tp) * tp if sp else num_tokens(**m)
    bnd, b6d = B * n_pad * D * 4, B * 6 * D * 4

    def e(count, nbytes):
        return {"count": count * n_micro, "bytes": count * n_micro * nbytes}

    out = {"all_gather/fwd/cond": {"count": (L + 1) * n_micro, "bytes": n_micro * (L * b6d + B * 2 * D * 4)},
           "all_reduce/bwd/cond": e(1, B * D * 4)}
    if not sp:
        out.update({"all_reduce/fwd/tp": e(2 * L, bnd), "all_reduce/bwd/tp": e(2 * L, bnd)})
    else:
        out.update({"all_gather/fwd/tp": e(2 * L, bnd), "reduce_scatter/fwd/tp": e(2 * L, bnd),
                    "reduce_scatter/bwd/tp": e(2 * L, bnd), "all_gather/bwd/tp": e((4 if regather else 2) * L, bnd),
                    "all_gather/fwd/sp_boundary": e(1, bnd), "all_gather/bwd/sp_boundary": e(1, bnd),
                    "reduce_scatter/bwd/cond": e(L, b6d)})
    if partial_bytes:
        out["all_reduce/bwd/param_grad"] = {"count": 1, "bytes": partial_bytes}
    return out


def partial_grad_bytes(module) -> int:
    """Bytes of the replicated parameters whose gradient is a per-TP-rank partial sum."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if getattr(p, "sequence_parallel", False) or getattr(p, "tp_partial_grad", False))


def recorded_comm(trainer, data) -> dict:
    """Collectives of one ``train_batch`` (``{"kind/direction/tag": {"count", "bytes"}}``)."""
    from vitp.parallel import CommRecorder

    with CommRecorder() as rec:
        trainer.engine.train_batch(data_iter=data)
    return {f"{k}/{d}/{t}": v for (k, d, t), v in sorted(rec.summary().items())}


def compare_comm(measured: dict, theory: dict) -> dict:
    """Per collective: measured and theory counts and bytes, and their bytes ratio."""
    rows = {}
    for key in sorted(set(measured) | set(theory)):
        m, t = measured.get(key, {"count": 0, "bytes": 0}), theory.get(key, {"count": 0, "bytes": 0})
        rows[key] = {"count": m["count"], "theory_count": t["count"], "bytes": m["bytes"],
                     "theory_bytes": t["bytes"], "ratio": round(m["bytes"] / t["bytes"], 4) if t["bytes"] else None}
    tot_m, tot_t = sum(r["bytes"] for r in rows.values()), sum(r["bytes"] for r in rows.values() if r["theory_bytes"])
    tot_t = sum(r["theory_bytes"] for r in rows.values())
    return {"per_collective": rows, "count": sum(r["count"] for r in rows.values()),
            "theory_count": sum(r["theory_count"] for r in rows.values()),
            "bytes_ratio": round(tot_m / tot_t, 4) if tot_t else None}


def tp_worker(size: str, reps: int, steps: int, tmp: str) -> dict:
    """vitp tp=2 vs DTensor tp=2, vitp tp=2 + SP vs vitp tp=2 (2 processes, interleaved)."""
    import itertools as it

    from vitp.parallel import distributed as dist

    cfg_tp = compose(size, ["parallel.tp=2"])
    cfg_sp = compose(size, ["parallel.tp=2", "parallel.sequence_parallel=true"])
    tp, tr_tp, micro = vitp_variant("vitp_tp", cfg_tp, f"{tmp}/tp-{size}")
    sp, tr_sp, _ = vitp_variant("vitp_sp", cfg_sp, f"{tmp}/sp-{size}")
    from vitp.models import Generator

    gen = dtensor_parallelize(Generator.from_config(cfg_tp.model, seed=cfg_tp.seed), 2)
    dt, _, _ = plain_variant("dtensor", cfg_tp, micro, model=gen, clip_norm=dtensor_clip)
    times = interleave([tp, sp, dt], reps, steps)  # first: the first-step losses are compared
    comm = {}
    for name, tr, cfg, sp_on in (("tp", tr_tp, cfg_tp, False), ("sp", tr_sp, cfg_sp, True)):
        theory = comm_theory(cfg, 2, sp_on, getattr(tr.state, "regather", True), partial_grad_bytes(tr.engine.module))
        comm[name] = compare_comm(recorded_comm(tr, it.cycle(micro)), theory)
    if not dist.is_main():
        return {}
    return {"tp_vs_dtensor": ratio(times, "vitp_tp", "dtensor"), "sp_vs_tp": ratio(times, "vitp_sp", "vitp_tp"),
            "first_loss": {v.name: v.first_loss for v in (tp, sp, dt)}, "comm": comm}


# ----------------------------------------------------------------------------- compiled blocks

def sampling_variant(name, tr, micro):
    """One sampler forward (no grad, eval mode) of the trainer's stage on the first micro-batch's
    inputs: what each ODE step of sampling runs (:class:`vitp.eval.inference.StageDenoiser`)."""
    import torch

    module, inputs = tr.engine.module, micro[0][0]

    def step():
        module.eval()
        with torch.no_grad():
            out = module(inputs)
        module.train()
        return float(out[0].float().mean()) if isinstance(out, tuple) else float(out.float().mean())

    return Variant(name, step)


def compile_worker(size: str, tp: int, reps: int, steps: int, tmp: str) -> dict:
    """Eager against ``trainer.compile=blocks`` (1 process or tp=2 + SP), interleaved: training
    steps and sampler forwards; the compile time of the first training step and of the first
    sampler forward (each a new shape / grad mode); graphs and graph breaks."""
    from vitp.models.compiled import compile_stats
    from vitp.parallel import distributed as dist

    extra = ["parallel.tp=2", "parallel.sequence_parallel=true"] if tp == 2 else []
    eager, tr_e, micro = vitp_variant("eager", compose(size, extra), f"{tmp}/eager-{size}-{tp}")
    comp, tr_c, _ = vitp_variant("compiled", compose(size, [*extra, "trainer.compile=blocks"]),
                                 f"{tmp}/compiled-{size}-{tp}")
    before = compile_stats()
    t0 = time.perf_counter()
    first = comp.step()  # interleave's warm-up would record the second step's loss
    first_step_s, train = time.perf_counter() - t0, compile_stats()
    s_eager, s_comp = sampling_variant("eager_sample", tr_e, micro), sampling_variant("compiled_sample", tr_c, micro)
    s_comp.step()
    sample = compile_stats()
    times = interleave([eager, comp], reps, steps)
    sampled = interleave([s_eager, s_comp], reps, steps)
    comp.first_loss = first
    if not dist.is_main():
        return {}
    return {"train": ratio(times, "compiled", "eager"), "sampling": ratio(sampled, "compiled_sample", "eager_sample"),
            "first_loss": {"eager": eager.first_loss, "compiled": comp.first_loss},
            "compile_s": {"train_shape": round(train["compile_s"] - before["compile_s"], 2),
                          "sampling_shape": round(sample["compile_s"] - train["compile_s"], 2),
                          "first_step_s": round(first_step_s, 2)},
            "graphs": sample["graphs"] - before["graphs"], "graph_breaks": sample["graph_breaks"] - before["graph_breaks"]}


def run_compile(args, sizes, tmp: str) -> dict:
    """The ``compile`` section: ``{"1proc": {size: ...}, "tp2": {size: ...}, "ratio_1proc",
    "ratio_tp2"}`` (the ratios: compiled / eager training step at the largest size)."""
    reps, steps = args.reps, args.steps
    out = {"1proc": {s: run_group(1, compile_worker, s, 1, reps, steps, tmp) for s in sizes},
           "tp2": {s: run_group(2, compile_worker, s, 2, reps, steps, tmp) for s in sizes}}
    out["ratio_1proc"] = out["1proc"][sizes[-1]]["train"]["ratio"]
    out["ratio_tp2"] = out["tp2"][sizes[-1]]["train"]["ratio"]
    return out


# ----------------------------------------------------------------------------- memory per rank

def memory_worker(size: str, tmp: str) -> dict:
    """Per-rank bytes at tp=2 x pp=2 (4 processes) after one step, against ``total / (tp pp)``."""
    import torch.distributed as tdist

    from vitp.models import Generator

    cfg = compose(size, ["parallel.tp=2", "parallel.pp=2"])
    full = Generator.from_config(cfg.model, seed=cfg.seed)
    total = sum(p.numel() * 4 for p in full.parameters())
    outer = sum(p.numel() * 4 for m in (full.embed, full.final) for p in m.parameters())
    del full
    base = live_tensor_bytes()
    vitp, tr, micro = vitp_variant("vitp", cfg, f"{tmp}/memory-{size}")
    vitp.step()
    module = tr.engine.module
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    ema = sum(t.numel() * t.element_size() for t in tr.ema.params.values())
    data = sum(t.numel() * t.element_size() for mb in micro for x in mb for t in x)
    state = live_tensor_bytes() - base - ema - data
    own_outer = sum(p.numel() * 4 for n, p in module.named_parameters()
                    if n.split(".", 1)[0] in ("0", str(cfg.model.depth + 1)))
    row = {"params": params, "grads_and_optimizer": state - params, "ideal": total // 4,
           "ideal_plus_embeddings": (total - outer) // 4 + own_outer,
           "stage": tr.state.pp_rank, "tp_rank": tr.state.tp_rank}
    row["params_vs_ideal"] = round(params / row["ideal"], 4)
    row["params_vs_ideal_plus_embeddings"] = round(params / row["ideal_plus_embeddings"], 4)
    rows = [None] * tdist.get_world_size()
    tdist.all_gather_object(rows, row)
    return {"total_param_bytes": total, "embed_final_bytes": outer, "ranks": rows,
            "max_params_vs_ideal_plus_embeddings": max(r["params_vs_ideal_plus_embeddings"] for r in rows)}


# ----------------------------------------------------------------------------- activations

def saved_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs
    (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def activations_worker(size: str) -> dict:
    """Saved bytes of one block at tp=1, tp=2 and tp=2 + SP (2 processes; rank 0's numbers)."""
    import dataclasses

    import torch

    from vitp.models import Block, layer_specs, num_tokens, parallelize_generator
    from vitp.parallel import distributed as dist
    from vitp.parallel import make_state, sequence_parallel_enter

    dist.init_distributed(torch.device("cpu"))
    cfg = compose(size)
    m = cfg.model
    N, D, B, a = num_tokens(**m), m.width, cfg.trainer.micro_batch_size, m.num_heads
    kw = layer_specs(**dict(cfg.model))[1][1]
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(B, N, D, generator=g, requires_grad=True), torch.randn(B, D, generator=g, requires_grad=True)
    base = make_state(tp=2)
    out = {}
    for name, state in (("tp1", None), ("tp2", base), ("tp2_sp", dataclasses.replace(base, sequence_parallel=True))):
        torch.manual_seed(1)
        blk = Block(**kw)
        if state is not None:
            parallelize_generator(blk, state, seq_len=N)
        xin = sequence_parallel_enter(x, state) if state is not None else x
        # the block input counts in every variant (Korthikanti et al. count the first layer norm's input)
        out[name] = saved_bytes(lambda: blk(xin, c), list(blk.parameters()) + [c])
    t, sbh = 2, N * B * D
    theory = {"tp2": (10 + 24 / t) / 34, "tp2_sp": (34 / t) / 34,
              "tp2_with_scores": (10 + 24 / t + 5 * a * N / (D * t)) / (34 + 5 * a * N / D),
              "tp2_sp_with_scores": (34 / t + 5 * a * N / (D * t)) / (34 + 5 * a * N / D)}
    return {"bytes": out, "per_sbh_fp32": {k: round(v / (sbh * 4), 3) for k, v in out.items()},
            "ratio_vs_tp1": {k: round(out[k] / out["tp1"], 4) for k in ("tp2", "tp2_sp")},
            "korthikanti_ratio": {k: round(v, 4) for k, v in theory.items()}}


# ----------------------------------------------------------------------------- pipeline

def pipeline_worker(size: str, micro_counts, reps: int, steps: int, tmp: str) -> dict:
    """At pp = world size: step time of one global batch split into ``m`` micro-batches, against
    one process running the same batch (rank 0; the other ranks wait), interleaved. Per ``m``: the
    step time (median over repetitions of the per-repetition median, min-max), its ratio to the
    previous ``m``'s step in the same repetition (median, min-max: paired, so load that drifts
    between repetitions cancels), the derived bubble ``1 - T_1 / (p T_m)`` against ``(p - 1) / (m + p - 1)``, and from the pipeline timeline
    (:mod:`vitp.train.timeline`, every timed step recorded) per stage the measured idle time
    against 1F1B with the stages' measured compute (``idle_1f1b_ms``), the recorded share of the
    step, and the CPU seconds every rank used per step (``time.process_time``) divided by the
    cores: the step cannot be shorter than that where ranks outnumber cores."""
    import torch.distributed as tdist

    from vitp.parallel import distributed as dist
    from vitp.train import Trainer
    from vitp.train.timeline import stage_fractions

    p = dist.world_size()
    gb = compose(size).trainer.global_batch_size
    runs = {}
    for m in micro_counts:
        cfg = compose(size, [f"parallel.pp={p}", f"trainer.micro_batch_size={gb // m}", "trainer.profile_steps=[1,1000000]"])
        tr = Trainer(cfg, f"{tmp}/pipe-{size}-{p}-{m}")
        micro = [next(tr.data_iter) for _ in range(tr.engine.gradient_accumulation_steps())]
        runs[m] = {"trainer": tr, "data": itertools.cycle(micro), "times": [], "cpu": []}
        if m == 1:
            one = micro
    plain = plain_variant("one_process", compose(size), one)[0] if dist.is_main() else Variant("one_process", lambda: 0.0)
    for _ in range(2):  # warm-up
        plain.step()
        for r in runs.values():
            r["trainer"].engine.train_batch(data_iter=r["data"])
    t_one, step = [], 0
    for rep in range(reps):
        order = list(runs) + ["one"]
        for key in order[rep % len(order):] + order[:rep % len(order)]:
            times, cpus = [], []
            for _ in range(steps):
                tdist.barrier()
                if key == "one":
                    t0 = time.perf_counter()
                    plain.step()
                    times.append(time.perf_counter() - t0)
                    continue
                r, step = runs[key], step + 1
                r["trainer"].timeline.begin(step)
                t0, c0 = time.perf_counter(), time.process_time()
                r["trainer"].engine.train_batch(data_iter=r["data"])
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                r["trainer"].timeline.end(step)  # gathers the events (outside the timed interval)
            if key == "one":
                t_one.append(statistics.median(times))
            else:
                runs[key]["times"].append(statistics.median(times))
                runs[key]["cpu"].append(statistics.median(cpus))
    cpu = {m: dist.gather_objects(statistics.median(r["cpu"])) for m, r in runs.items()}
    if not dist.is_main():
        return {}
    cores = len(os.sched_getaffinity(0))
    t1 = statistics.median(t_one)
    out = {}
    for m, r in runs.items():
        tm = r["times"]
        bub = [1 - t1 / (p * x) for x in tm]
        fr = stage_fractions([x for ranks in r["trainer"].timeline.gathered for x in ranks])
        out[str(m)] = {"step_ms": round(1e3 * statistics.median(tm), 1), "step_ms_min": round(1e3 * min(tm), 1),
                       "step_ms_max": round(1e3 * max(tm), 1), "bubble": round(statistics.median(bub), 3),
                       "bubble_min": round(min(bub), 3), "bubble_max": round(max(bub), 3),
                       "theory_1f1b": round((p - 1) / (m + p - 1), 3),
                       "cpu_bound_ms": round(1e3 * sum(cpu[m]) / cores, 1),
                       "stages": {str(s): {"idle_ms": round(f["idle_ms"], 1), "idle_1f1b_ms": round(f["idle_1f1b_ms"], 1),
                                           "idle_vs_1f1b": round(f["idle_ms"] / f["idle_1f1b_ms"], 3) if f["idle_1f1b_ms"] > 0 else None,
                                           "compute_ms": round(f["compute_ms"], 1), "comm": round(f["comm"], 4),
                                           "wait": round(f["wait"], 4), "gap": round(f["gap"], 4),
                                           "recorded": round(f["busy_ms"] / f["step_ms"], 4)}
                                  for s, f in sorted(fr.items())}}
    for a, b in zip(micro_counts, micro_counts[1:]):  # paired within a repetition: slow drifts of load cancel
        rs = [y / x for x, y in zip(runs[a]["times"], runs[b]["times"])]
        out[str(b)]["vs_previous"] = {"m": a, "ratio": round(statistics.median(rs), 4), "min": round(min(rs), 4),
                                      "max": round(max(rs), 4)}
    medians = [out[str(m)]["step_ms"] for m in micro_counts]
    return {"pp": p, "cores": cores, "one_process_ms": round(1e3 * t1, 2), "micro_batches": out,
            "non_increasing": all(b <= a for a, b in zip(medians, medians[1:])),
            "non_increasing_paired": all(out[str(m)]["vs_previous"]["ratio"] <= 1 for m in micro_counts[1:])}


# ----------------------------------------------------------------------------- context parallelism

# (a), (b): a video generator; "video": 16 frames of 128x128 px at patch 8, tubelet 1 -> grid
# (16, 16, 16), N = 4096 tokens, width 64, depth 2, 4 heads, one sample per micro-batch
CP_MODELS = {
    "video": ["data.channels=3", "data.num_classes=10", "data.num_frames=16", "data.resolution=128",
              "model.patch_size=8", "model.tubelet_size=1", "model.width=64", "model.depth=2", "model.num_heads=4",
              "trainer.global_batch_size=1", "trainer.micro_batch_size=1"],
    # --quick: grid (4, 4, 4), N = 64, width 32, 4 heads, 2 samples
    "tiny": ["data.channels=3", "data.num_classes=10", "data.num_frames=4", "data.resolution=16", "model.patch_size=4",
             "model.tubelet_size=1", "model.width=32", "model.depth=2", "model.num_heads=4",
             "trainer.global_batch_size=2", "trainer.micro_batch_size=2"],
}
# (c): one attention layer at cp = 2: (micro, tokens, width, heads)
CP_ATTENTION = {"video": (1, 4096, 128, 4), "tiny": (2, 64, 32, 4)}
# per attention kind: the cp modes measured (factorized attention has one way to split)
CP_LAYOUTS = (("full", "ulysses"), ("full", "ring"), ("factorized", "ulysses"))
CP_DEGREES = (1, 2, 4)


def cp_config(size: str, attention: str):
    return _compose_cp([*BASE, *CP_MODELS[size], f"model.attention={attention}"])


def _compose_cp(overrides):
    from vitp.config import compose as _compose

    return _compose(overrides)


def cp_batch(cfg):
    """One micro-batch ``(z_t, t, y)`` and the flow-matching targets ``(x, z_t, t)``, identical on every rank."""
    import torch

    from vitp.config import parse_resolution

    m, B = cfg.model, cfg.trainer.micro_batch_size
    (H, W) = parse_resolution(m.image_size)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, m.in_channels, m.num_frames, H, W, generator=g)
    z = torch.randn(x.shape, generator=g)
    t = torch.rand(B, generator=g)
    y = torch.randint(0, m.num_classes + 1, (B,), generator=g)
    return (z, t, y), (x, z, t)


def region_saved_bytes(model, inputs, targets, loss_fn):
    """Forward of one training micro-batch (generator and flow-matching loss) with a
    saved-tensor hook: ``(loss, {"total", "cp_region", "full_size"})``, bytes of the distinct
    storages autograd saves, parameters excluded. ``full_size``: what every cp rank holds whole,
    i.e. storages first saved outside the token-sharded region (the input pixels saved by the
    patch embedding, the timestep and class embeddings, the gathered prediction and the loss's
    targets) plus the rest of the patch embedding's output ``(B, N, D)`` when a saved view of
    this rank's shard keeps it alive (the split's chunk of a ``B = 1`` batch is a view of it);
    ``cp_region``: the rest, the activations between the split and the head's gather."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, where = {}, {"inside": False, "embed": None}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            own = t.numel() * t.element_size() if st.data_ptr() == where["embed"] else st.nbytes()
            seen[st.data_ptr()] = (st.nbytes(), own if where["inside"] else 0)  # (bytes, of them in the region)
        return t

    def enter(_m, _a, out):  # prepended: runs before the cp split's hook
        where.update(inside=True, embed=out[0].untyped_storage().data_ptr())

    hooks = [model.embed.register_forward_hook(enter, prepend=True),
             model.final.linear.register_forward_hook(lambda *a: where.update(inside=False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(*inputs), targets)
    finally:
        for h in hooks:
            h.remove()
    total, inside = (sum(v[i] for v in seen.values()) for i in (0, 1))
    return loss, {"total": total, "cp_region": inside, "full_size": total - inside}


def cp_theory(cfg, model, cp: int, mode: str):
    """Predicted cp collectives of one micro-batch (forward + backward), fp32:
    :func:`vitp.parallel.styles.context_collectives` of every block plus the boundary gather of
    the head's output ``micro * N * P * 4`` bytes (``P = pt p p C``)."""
    from vitp.models import num_tokens
    from vitp.parallel.styles import Collective, StepShape, context_collectives

    m, B = cfg.model, cfg.trainer.micro_batch_size
    N, P = num_tokens(**m), m.tubelet_size * m.patch_size ** 2 * m.in_channels
    shape = StepShape(micro=B, tokens=N, width=m.width, act_bytes=4, tp=1, cp=cp, cp_mode=mode)
    out = []
    for blk in model.blocks:
        groups = getattr(blk, "token_groups", None)
        out += context_collectives(shape, groups.kind if groups is not None else "full")
    return out + ([Collective("all_gather", "fwd", "cp_boundary", B * N * P * 4)] if cp > 1 else [])


def compare_cp_comm(records, theory, cp: int) -> dict:
    """Measured cp records against :func:`cp_theory`: per ``kind/direction/tag`` counts and
    logical bytes, and the bytes one rank sends (:func:`vitp.parallel.comm.wire_bytes`)."""
    from collections import defaultdict

    meas, pred = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    for r in records:
        meas[f"{r.kind}/{r.direction}/{r.tag}"][0] += 1
        meas[f"{r.kind}/{r.direction}/{r.tag}"][1] += r.nbytes
    for c in theory:
        pred[f"{c.kind}/{c.direction}/{c.tag}"][0] += c.count
        pred[f"{c.kind}/{c.direction}/{c.tag}"][1] += int(c.count * c.nbytes)
    rows = {k: {"count": meas[k][0], "theory_count": pred[k][0], "bytes": meas[k][1], "theory_bytes": pred[k][1]}
            for k in sorted(set(meas) | set(pred))}
    wire = sum(int(r.wire()) for r in records)
    wire_theory = int(sum(c.wire_bytes(cp) for c in theory))
    return {"per_collective": rows, "wire_bytes": wire, "theory_wire_bytes": wire_theory,
            "equal": wire == wire_theory and all(r["count"] == r["theory_count"] and r["bytes"] == r["theory_bytes"]
                                                 for r in rows.values())}


def cp_layout_numbers(cfg, state, cp: int, mode: str) -> dict:
    """Saved bytes (forward) and cp collectives (forward + backward) of one micro-batch at one layout."""
    from vitp.models import Generator, parallelize_generator, token_grid
    from vitp.objectives import FlowMatchingLoss
    from vitp.parallel import CommRecorder

    model, m = Generator.from_config(cfg.model, seed=cfg.seed), cfg.model
    if cp > 1:
        parallelize_generator(model, state, grid=token_grid(m.image_size, m.num_frames, m.patch_size, m.tubelet_size))
    inputs, targets = cp_batch(cfg)
    with CommRecorder() as rec:
        loss, saved = region_saved_bytes(model, inputs, targets, FlowMatchingLoss(cfg.objective.t_eps))
        loss.backward()
    records = [r for r in rec.records if r.tag in ("cp", "cp_boundary")]
    return {"saved": saved, "loss": float(loss.detach()), "others": len(rec.records) - len(records),
            "comm": compare_cp_comm(records, cp_theory(cfg, model, cp, mode), cp)}


def cp_memory_comm_worker(size: str) -> dict:
    """(a) saved activation bytes per rank and (b) cp collectives against theory, at cp = 1, 2, 4
    for every :data:`CP_LAYOUTS` (4 processes; cp = 1 and 2 run as dp x cp layouts of them)."""
    import torch
    import torch.distributed as tdist

    from vitp.parallel import distributed as dist
    from vitp.parallel import make_state

    dist.init_distributed(torch.device("cpu"))
    world, out = tdist.get_world_size(), {}
    for attention, mode in CP_LAYOUTS:
        cfg = cp_config(size, attention)
        for cp in [c for c in CP_DEGREES if c > 1 or mode == "ulysses"]:  # cp = 1: no mode
            state = make_state(tp=1, cp=cp, dp=world // cp, cp_mode=mode)
            row = cp_layout_numbers(cfg, state, cp, mode)
            rows = [None] * world
            tdist.all_gather_object(rows, row)
            row["saved_max_over_ranks"] = {k: max(r["saved"][k] for r in rows) for k in row["saved"]}
            row["comm_equal_all_ranks"] = all(r["comm"]["equal"] for r in rows)
            out[f"{attention}/{mode}/cp={cp}"] = row
    return _cp_ratios(out) if dist.is_main() else {}


def _cp_ratios(rows: dict) -> dict:
    """Saved bytes of every layout over those of cp = 1 (same attention), against ``1 / cp``."""
    for key, row in rows.items():
        attention, _, cpk = key.split("/")
        cp, base = int(cpk.split("=")[1]), rows[f"{attention}/ulysses/cp=1"]["saved_max_over_ranks"]
        s = row["saved_max_over_ranks"]
        row["ratio_vs_cp1"] = {k: round(s[k] / base[k], 4) for k in ("total", "cp_region")}
        row["target"] = round(1 / cp, 4)
        row["cp_region_within_5pct"] = abs(s["cp_region"] / base["cp_region"] * cp - 1) <= 0.05
    return rows


class DeepSpeedUlysses:
    """timm ``Attention``'s ``qkv`` and ``proj`` around DeepSpeed-Ulysses'
    ``deepspeed.sequence.layer.DistributedAttention`` (``scatter_idx=2``, ``gather_idx=1``,
    ``batch_dim_idx=0``: ``(B, N / cp, H, hd)`` -> ``(B, N, H / cp, hd)`` by all-to-all, as its
    ``_generate_layout_params`` reads a batch-first input) with ``F.scaled_dot_product_attention``
    as the local attention. ``__call__``: ``(B, N / cp, D)`` -> ``(B, N / cp, D)``."""

    def __init__(self, attn, group):
        from deepspeed.sequence.layer import DistributedAttention

        self.attn = attn
        self.core = DistributedAttention(self._local, group, scatter_idx=2, gather_idx=1)

    def _local(self, q, k, v):
        import torch.nn.functional as F

        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=self.attn.scale)
        return o.transpose(1, 2)  # (B, N, H / cp, hd)

    def parameters(self):
        return self.attn.parameters()

    def __call__(self, x):
        a, (B, n, D) = self.attn, x.shape
        q, k, v = a.qkv(x).reshape(B, n, 3, a.num_heads, a.head_dim).unbind(2)
        return a.proj(self.core(q, k, v, batch_dim_idx=0).reshape(B, n, D))


def cp_attention_modules(shape, state):
    """The same timm ``Attention`` (seeded) as vitp's Ulysses and ring attention
    (:class:`vitp.parallel.TPAttention` at tp = 1 with a :class:`vitp.parallel.context.ContextAttention`,
    what the generator's plan makes of it) and as :class:`DeepSpeedUlysses`."""
    import copy

    import torch
    from timm.layers import Attention

    from vitp.parallel import TPAttention
    from vitp.parallel.context import ContextAttention

    B, N, D, H = shape
    torch.manual_seed(4)
    attn = Attention(D, num_heads=H, qkv_bias=True)
    mods = {}
    for mode in ("ulysses", "ring"):
        m = TPAttention.from_timm(copy.deepcopy(attn), state, N)
        m.set_context(ContextAttention(state.cp_group, state.cp_size, mode, (N, 1, 1)))
        mods[f"vitp_{mode}"] = m
    mods["deepspeed_ulysses"] = DeepSpeedUlysses(copy.deepcopy(attn), state.cp_group)
    return attn, mods


def cp_attention_worker(shape, reps: int, steps: int) -> dict:
    """(c) forward + backward of one attention layer (qkv and proj included alike) at cp = 2:
    vitp's Ulysses against DeepSpeed's ``DistributedAttention`` and vitp's ring, interleaved
    (2 processes, one thread each); once, every output against the unsharded attention."""
    import torch
    import torch.distributed as tdist

    from vitp.parallel import distributed as dist
    from vitp.parallel import make_state

    dist.init_distributed(torch.device("cpu"))
    state = make_state(tp=1, cp=2)
    B, N, D, H = shape
    full, mods = cp_attention_modules(shape, state)
    g = torch.Generator().manual_seed(5)
    x_full, w_full = torch.randn(B, N, D, generator=g), torch.randn(B, N, D, generator=g)
    x, w = (t.chunk(2, dim=1)[state.cp_rank].contiguous() for t in (x_full, w_full))
    with torch.no_grad():
        ref = full(x_full).chunk(2, dim=1)[state.cp_rank]
        outs = {k: m(x) for k, m in mods.items()}
    diff = torch.tensor([float((outs["vitp_ulysses"] - outs["deepspeed_ulysses"]).abs().max())]
                        + [float((o - ref).abs().max()) for o in outs.values()], dtype=torch.float64)
    tdist.all_reduce(diff, op=tdist.ReduceOp.MAX)

    def step_of(m):
        params = list(m.parameters())

        def step():
            for p in params:
                p.grad = None
            xi = x.detach().requires_grad_()
            loss = (m(xi) * w).sum()
            loss.backward()
            return float(loss.detach())
        return step

    variants = [Variant(k, step_of(m)) for k, m in mods.items()]
    times = interleave(variants, reps, steps)
    if not dist.is_main():
        return {}
    return {"shape": {"micro": B, "tokens": N, "width": D, "heads": H, "cp": 2},
            "max_abs_diff": {"vitp_ulysses_vs_deepspeed": float(diff[0]),
                             **{f"{k}_vs_unsharded": float(d) for k, d in zip(outs, diff[1:])}},
            "vitp_vs_deepspeed": ratio(times, "vitp_ulysses", "deepspeed_ulysses"),
            "ring_vs_ulysses": ratio(times, "vitp_ring", "vitp_ulysses"),
            "first_loss": {v.name: v.first_loss for v in variants}}


CP_DESCRIPTION = {"video": "video generator, 16 frames of 128x128 px, patch 8, tubelet 1: N = 4096 tokens, width 64, "
                           "depth 2, 4 heads, 1 sample, fp32",
                  "tiny": "tiny video generator, grid 4x4x4: N = 64 tokens, width 32, depth 2, 4 heads, 2 samples, fp32"}
CP_FORMULA = ("per micro-batch and rank, fp32 (e = 4), T = B (N / cp) D e: Ulysses and the temporal blocks "
              "2 x all-to-all (3T + T) (fwd + bwd), spatial blocks 0, ring send_recv 2T (cp - 1) fwd, "
              "2T (cp - 1) + 2T cp (fp32 dK, dV) bwd (vitp.parallel.styles.context_collectives per block), "
              "plus all_gather fwd of the prediction B N P e (P = pt p p C, tag cp_boundary); wire bytes = "
              "(cp - 1) / cp x logical bytes for all_gather / all_to_all, logical bytes for send_recv")


def run_cp(args) -> dict:
    """The ``cp`` section: (a) + (b) on 4 processes, (c) on 2 (:data:`CP_MODELS`, :data:`CP_ATTENTION`)."""
    size = "tiny" if args.quick else "video"
    return {"model": CP_DESCRIPTION[size], "formula": CP_FORMULA,
            "memory_comm": run_group(4, cp_memory_comm_worker, size, timeout=600),
            "attention": run_group(2, cp_attention_worker, CP_ATTENTION[size], args.reps, args.steps, timeout=600)}


# ----------------------------------------------------------------------------- report

def _fmt_ratio(r: dict) -> str:
    return f"{r['ratio']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def markdown(res: dict) -> str:
    """The Markdown tables of a result dict (docs/performance.md)."""
    lines = [f"Measured by `python scripts/bench.py{' --quick' if res['quick'] else ''}` ({res['when']}): "
             f"{res['reps']} interleaved repetitions of {res['steps']} steps, median ratio (min-max).", ""]
    for name, load in res.get("load", {}).items():
        lines += [f"Load during `{name}`: 1-minute load average median {load['median']} (10-90 %: {load['p10']}-"
                  f"{load['p90']}, {load['samples']} samples), {load['busy_processes']} busy-loop processes added.", ""]
    if "overhead" in res:
        lines += ["| size | tokens | batch | vitp ms | plain ms | vitp / plain | model-state bytes vitp / plain |",
                  "|---|---|---|---|---|---|---|"]
        for size, r in res["overhead"].items():
            lines.append(f"| {size} | {r['tokens']} | {r['batch']} | {r['vitp_ms']} | {r['plain_ms']} | "
                         f"{_fmt_ratio(r)} | {r['model_state_bytes']['ratio']:.3f} |")
        lines.append("")
    if "tp" in res:
        lines += ["| size | vitp tp=2 / DTensor tp=2 | vitp SP / vitp tp=2 | collectives TP (theory) | "
                  "collectives SP (theory) | SP bytes / theory |", "|---|---|---|---|---|---|"]
        for size, r in res["tp"].items():
            c = r["comm"]
            lines.append(f"| {size} | {_fmt_ratio(r['tp_vs_dtensor'])} | {_fmt_ratio(r['sp_vs_tp'])} | "
                         f"{c['tp']['count']} ({c['tp']['theory_count']}) | {c['sp']['count']} "
                         f"({c['sp']['theory_count']}) | {c['sp']['bytes_ratio']} |")
        lines.append("")
    if "memory" in res:
        r = res["memory"]
        lines += ["| rank (stage, tp) | param bytes | / ideal | / (ideal + embeddings) | grads + optimizer bytes |",
                  "|---|---|---|---|---|"]
        for row in r["ranks"]:
            lines.append(f"| ({row['stage']}, {row['tp_rank']}) | {row['params']} | {row['params_vs_ideal']} | "
                         f"{row['params_vs_ideal_plus_embeddings']} | {row['grads_and_optimizer']} |")
        lines.append("")
    if "activations" in res:
        r = res["activations"]
        lines += ["| saved bytes per block | tp=2 / tp=1 | tp=2 SP / tp=1 |", "|---|---|---|",
                  f"| measured | {r['ratio_vs_tp1']['tp2']} | {r['ratio_vs_tp1']['tp2_sp']} |",
                  f"| Korthikanti et al. 2022 (no score matrix; with it) | {r['korthikanti_ratio']['tp2']}; "
                  f"{r['korthikanti_ratio']['tp2_with_scores']} | {r['korthikanti_ratio']['tp2_sp']}; "
                  f"{r['korthikanti_ratio']['tp2_sp_with_scores']} |", ""]
    if "pipeline" in res:
        lines += _pipeline_markdown(res["pipeline"])
    if "tokens" in res:
        lines += ["| tokens | vitp ms | plain ms | vitp / plain |", "|---|---|---|---|"]
        for n, r in res["tokens"].items():
            lines.append(f"| {n} | {r['vitp_ms']} | {r['plain_ms']} | {_fmt_ratio(r)} |")
        lines.append("")
    if "cp" in res:
        lines += _cp_markdown(res["cp"])
    if "compile" in res:
        lines += _compile_markdown(res["compile"])
    return "\n".join(lines)


def _pipeline_markdown(res: dict) -> list:
    """The table of the ``pipeline`` section: per pp and m, step time, derived bubble, and per stage
    the timeline's idle time against 1F1B with the measured stage compute."""
    lines = []
    for r in res.values():
        p = r["pp"]
        lines += [f"pp={p}, one global batch; one process: {r['one_process_ms']} ms; {r['cores']} cores; step time "
                  f"non-increasing in m: medians {'yes' if r['non_increasing'] else 'NO'}, paired ratios "
                  f"{'yes' if r.get('non_increasing_paired') else 'NO'}", "",
                  "| m | step ms (min-max) | / previous m, paired (min-max) | bubble (min-max) | 1F1B theory "
                  "| per stage: idle ms / 1F1B idle ms = ratio | CPU-bound ms |", "|---|---|---|---|---|---|---|"]
        for m, row in r["micro_batches"].items():
            stages = "; ".join(f"{s}: {x['idle_ms']:.0f} / {x['idle_1f1b_ms']:.0f} = {x['idle_vs_1f1b']}"
                               for s, x in row["stages"].items())
            prev = row.get("vs_previous")
            paired = f"{prev['ratio']} ({prev['min']}-{prev['max']})" if prev else "-"
            lines.append(f"| {m} | {row['step_ms']} ({row['step_ms_min']}-{row['step_ms_max']}) | {paired} | {row['bubble']} "
                         f"({row['bubble_min']}-{row['bubble_max']}) | {row['theory_1f1b']} | {stages} | "
                         f"{row['cpu_bound_ms']} |")
        lines.append("")
    return lines


def _compile_markdown(r: dict) -> list:
    lines = ["| layout | size | compiled / eager train step | eager ms | compiled ms | compiled / eager sampling "
             "forward | compile s (train shape, sampling shape) | graphs | graph breaks |", "|---|---|---|---|---|---|---|---|---|"]
    for layout in ("1proc", "tp2"):
        for size, x in r[layout].items():
            c = x["compile_s"]
            lines.append(f"| {layout} | {size} | {_fmt_ratio(x['train'])} | {x['train']['eager_ms']} | "
                         f"{x['train']['compiled_ms']} | {_fmt_ratio(x['sampling'])} | {c['train_shape']}, "
                         f"{c['sampling_shape']} | {x['graphs']} | {x['graph_breaks']} |")
    return lines + ["", f"compile.ratio_1proc = {r['ratio_1proc']}, compile.ratio_tp2 = {r['ratio_tp2']} "
                        "(largest size)", ""]


def _cp_markdown(r: dict) -> list:
    """The tables of the ``cp`` section."""
    m = r["memory_comm"]
    lines = [f"Context parallelism ({r['model']}): saved activation bytes of one training micro-batch forward "
             "(generator + flow-matching loss) per rank, and cp collectives of forward + backward against theory. "
             "`cp region` = the token-sharded activations between the embedding's split and the output head; "
             "`total` adds what every cp rank holds whole (input pixels, timestep/class embeddings, the gathered "
             "prediction and the loss's targets).", "",
             "| attention / mode / cp | saved total | / cp=1 | saved cp region | / cp=1 | target 1/cp | "
             "cp wire bytes / rank | theory | equal |", "|---|---|---|---|---|---|---|---|---|"]
    for key, row in m.items():
        s, q, c = row["saved_max_over_ranks"], row["ratio_vs_cp1"], row["comm"]
        lines.append(f"| {key} | {s['total']} | {q['total']} | {s['cp_region']} | {q['cp_region']} | {row['target']} | "
                     f"{c['wire_bytes']} | {c['theory_wire_bytes']} | {c['equal'] and row['comm_equal_all_ranks']} |")
    a = r["attention"]
    sh, d = a["shape"], a["max_abs_diff"]
    lines += ["", f"Theory: {r['formula']}.", "",
              f"One attention layer (qkv + attention + proj, forward + backward) at cp=2, B={sh['micro']}, "
              f"N={sh['tokens']}, D={sh['width']}, {sh['heads']} heads: median ratio (min-max) over repetitions; "
              f"max |vitp Ulysses - DeepSpeed| = {d['vitp_ulysses_vs_deepspeed']:.3g}, against the unsharded "
              f"attention: vitp Ulysses {d['vitp_ulysses_vs_unsharded']:.3g}, ring {d['vitp_ring_vs_unsharded']:.3g}, "
              f"DeepSpeed {d['deepspeed_ulysses_vs_unsharded']:.3g}.", "",
              "| comparison | ratio (min-max) | ms |", "|---|---|---|",
              f"| vitp Ulysses / DeepSpeed DistributedAttention | {_fmt_ratio(a['vitp_vs_deepspeed'])} | "
              f"{a['vitp_vs_deepspeed']['vitp_ulysses_ms']} / {a['vitp_vs_deepspeed']['deepspeed_ulysses_ms']} |",
              f"| vitp ring / vitp Ulysses | {_fmt_ratio(a['ring_vs_ulysses'])} | "
              f"{a['ring_vs_ulysses']['vitp_ring_ms']} / {a['ring_vs_ulysses']['vitp_ulysses_ms']} |", ""]
    return lines


SECTIONS = ("overhead", "tp", "memory", "activations", "pipeline", "tokens", "cp", "compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repetitions (smoke test)")
    p.add_argument("--out", default="bench", help="writes OUT.json and OUT.md")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 7, --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per variant per repetition (default 3, --quick 1)")
    p.add_argument("--sizes", default=None, help="comma-separated of demo,large (default both; --quick: tiny)")
    p.add_argument("--sections", default=None, help=f"comma-separated of {','.join(SECTIONS)} (default all; "
                   "--quick: all but compile, whose compiles take a minute even on the tiny model)")
    p.add_argument("--load", type=int, default=0,
                   help="busy-loop processes run alongside every section (a controlled load; default 0)")
    return p.parse_args(argv)


@contextlib.contextmanager
def machine_load(busy: int, every: float = 10.0):
    """Run ``busy`` busy-loop processes (a controlled load, ``--load``) and sample the 1-minute
    load average every ``every`` seconds. Yields a dict filled in on exit: ``busy_processes``,
    ``samples`` and the samples' ``median``, ``p10`` and ``p90`` (runnable processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    samples, stop = [], threading.Event()

    def sample():
        samples.append(os.getloadavg()[0])
        while not stop.wait(every):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stats = {"busy_processes": busy}
    try:
        yield stats
    finally:
        stop.set()
        thread.join()
        for proc in procs:
            proc.kill()
            proc.wait()
        q = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples
        stats.update(samples=len(samples), median=round(statistics.median(samples), 2), p10=round(q[0], 2),
                     p90=round(q[-1], 2))


def run_sections(args, sizes, tmp: str) -> dict:
    res, sections = {}, args.sections.split(",")
    partial = Path(f"{args.out}.partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    sections = [s for s in SECTIONS if s in sections]
    for name in sections:  # each section's results are kept as soon as it ends
        with machine_load(args.load) as load:
            res[name] = run_section(name, args, sizes, tmp)
        res.setdefault("load", {})[name] = load
        partial.write_text(json.dumps(res, indent=1))
    partial.unlink(missing_ok=True)
    return res


def run_section(name: str, args, sizes, tmp: str):
    reps, steps = args.reps, args.steps
    res, sections = {}, [name]
    if "overhead" in sections:
        res["overhead"] = {s: run_group(1, overhead_worker, s, reps, steps, tmp) for s in sizes}
    if "tp" in sections:
        res["tp"] = {s: run_group(2, tp_worker, s, reps, steps, tmp) for s in sizes}
    if "memory" in sections:
        res["memory"] = run_group(4, memory_worker, sizes[-1], tmp)
    if "activations" in sections:
        res["activations"] = run_group(2, activations_worker, sizes[-1])
    if "pipeline" in sections:
        counts, pps = ((1, 2), (2,)) if args.quick else ((1, 2, 4, 8), (2, 3))
        res["pipeline"] = {f"pp{pp}": run_group(pp, pipeline_worker, sizes[-1], counts, reps, steps, tmp) for pp in pps}
    if "tokens" in sections:
        res["tokens"] = run_group(1, tokens_worker, "tiny" if args.quick else "demo",
                                  (8,) if args.quick else (8, 16, 32), reps, steps, tmp)
    if "cp" in sections:
        res["cp"] = run_cp(args)
    if "compile" in sections:
        res["compile"] = run_compile(args, sizes, tmp)
    return res[name]


def main(argv=None) -> None:
    args = parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 7)
    args.steps = args.steps or (1 if args.quick else 3)
    args.sections = args.sections or ",".join(s for s in SECTIONS if not (args.quick and s == "compile"))
    sizes = (args.sizes or ("tiny" if args.quick else "demo,large")).split(",")
    with tempfile.TemporaryDirectory(prefix="vitp-bench-") as tmp:
        res = run_sections(args, sizes, tmp)
    res.update(quick=args.quick, reps=args.reps, steps=args.steps, when=time.strftime("%Y-%m-%d %H:%M"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
    Path(f"{args.out}.md").write_text(markdown(res))
    print(markdown(res))
    print(json.dumps({"json": f"{args.out}.json", "markdown": f"{args.out}.md"}))


if __name__ == "__main__":
    main()
