#!/usr/bin/env python
"""Does an interleaved (virtual-stage) 1F1B schedule pay on vitp's pipeline stages? A measurement.

    python scripts/bench_schedule.py [--pp 2] [--micro-batches 4,8] [--reps 5] [--steps 2] [--quick] [--out PREFIX]

On ``pp`` local processes (gloo, CPU, one thread each) at the bench's ``large`` size (width 384,
depth 6, 6 heads, 256 tokens, global batch 16, fp32; ``--quick``: the ``tiny`` size with
``model.depth = 2 pp`` so that every virtual stage holds a block), for each number ``m`` of
micro-batches one training step of the same model on the same ``m`` micro-batches, three ways:

(a) ``deepspeed_1f1b``: vitp's own step, ``Trainer(cfg, run_dir).engine.train_batch`` at
    ``parallel.pp = pp`` (DeepSpeed's synchronous 1F1B ``TrainSchedule``);
(b) ``torch_1f1b``: PyTorch's ``torch.distributed.pipelining.Schedule1F1B``, one stage per rank
    holding the layers DeepSpeed gives that rank (``PipelineModule.parts``);
(c) ``torch_interleaved_1f1b``: ``torch.distributed.pipelining.ScheduleInterleaved1F1B``
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", arXiv 2104.04473, Sec. 2.2.2) with 2 virtual stages per rank: the layer list cut
    into ``2 pp`` chunks by DeepSpeed's ``type:BlockPipe`` balancing, rank ``r`` holding chunks
    ``r`` and ``r + pp``.

(b) and (c) build the layers as vitp does (:func:`vitp.models.layer_specs`, the tuple-passing
adapters of :mod:`vitp.pipeline.stages`, layer ``i`` built after ``seed_layer(cfg.seed + i)``), so
their weights equal DeepSpeed's; the loss is :class:`vitp.objectives.FlowMatchingLoss` per
micro-batch, gradients averaged over micro-batches (torch's ``scale_grads=True`` divides the
accumulated gradients by ``m``, as DeepSpeed's ``1 / gradient_accumulation_steps`` loss scaling
does). Every variant's timed step is forward + backward of all micro-batches, the mean loss on
every rank (DeepSpeed's ``train_batch`` broadcasts it from the last stage; (b) and (c) broadcast it
too), and vitp's optimizer step: :class:`vitp.train.engine.ExactClipAdamW` (torch AdamW with vitp's
parameter groups, clipping by the exact global grad norm, its square all-reduced over the pp
ranks), then ``zero_grad``.

Timing: after 3 untimed steps of each (they give the parity numbers below), ``reps``
repetitions of ``steps`` steps of each variant in turn (A, B, C; the order rotated each
repetition as in ``scripts/bench.py``), a ``torch.distributed.barrier()`` before each step; a
step's time is the maximum over ranks; per repetition the median of its steps; reported: the
median over repetitions and its min-max, and the median (min-max) over repetitions of the ratio
to (a).

Parity (the 3 untimed steps, from the same initial weights): each variant's losses, and against
(a) the max abs difference of the initial weights, per step of every gradient before clipping
(step 1 alone would check little: the generator's output layer and adaLN gates start at zero, so
only the output layer has a gradient at step 1 and nothing flows back across the stages; from
step 2 on gradients cross them), the relative difference of the loss and the global grad norm,
and the max abs difference of every weight after step 3 (parameters matched by their DeepSpeed
name ``<layer index>.<name>``). The weights alone would hide a gradient scale error: Adam's
update barely depends on the gradients' scale.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import SIZES, Variant, compose, run_group  # noqa: E402

NAMES = ("deepspeed_1f1b", "torch_1f1b", "torch_interleaved_1f1b")
LABELS = {"deepspeed_1f1b": "(a) vitp / DeepSpeed 1F1B", "torch_1f1b": "(b) torch Schedule1F1B",
          "torch_interleaved_1f1b": "(c) torch ScheduleInterleaved1F1B, 2 virtual stages"}
VIRTUAL = 2  # virtual stages (model chunks) per rank of (c)
PARITY_STEPS = 3  # untimed first steps of each variant whose gradients, losses and weights are compared


# ----------------------------------------------------------------------------- model chunks

def chunk_module(layers: dict):
    """An ``nn.Module`` holding ``layers`` (``{global layer index: module}``, registered under
    ``str(index)`` as DeepSpeed's ``PipelineModule`` names them) that applies them in order to the
    activation tuple given as positional arguments: ``(z_t, t, y)`` or ``(tokens (b, N, D),
    c (b, D))`` in, ``(tokens, c)`` or ``x_pred (b, C, T, H, W)`` out."""
    import torch

    class _Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.order = sorted(layers)
            for i in self.order:
                self.add_module(str(i), layers[i])

        def forward(self, *acts):
            x = acts
            for i in self.order:
                x = getattr(self, str(i))(x)
            return x

    return _Chunk()


def build_layers(cfg, indices) -> dict:
    """``{i: layer i}`` for ``i`` in ``indices``: the pipeline adapters of
    :mod:`vitp.pipeline.stages` over :func:`vitp.models.layer_specs`, layer ``i`` built right after
    ``seed_layer(cfg.seed + i)`` (DeepSpeed's ``seed_layers=True``), so the weights equal DeepSpeed's."""
    from vitp.models import Block, Embed, FinalLayer, layer_specs, seed_layer
    from vitp.pipeline.stages import BlockPipe, EmbedPipe, FinalPipe
    from vitp.utils import to_dict

    adapter = {Embed: EmbedPipe, Block: BlockPipe, FinalLayer: FinalPipe}  # as build_pipeline's LayerSpecs
    out = {}
    for i, (cls, kw) in enumerate(layer_specs(**to_dict(cfg.model))):
        if i in indices:
            seed_layer(cfg.seed + i)
            out[i] = adapter[cls](**kw)
    return out


def interleaved_parts(depth: int, pp: int) -> list:
    """Layer boundaries of the ``VIRTUAL * pp`` chunks of (c): DeepSpeed's ``type:BlockPipe``
    balancing (``partition_balanced`` over Embed, ``depth`` blocks, FinalLayer) into that many parts.

    Raises ``ValueError`` when ``depth < VIRTUAL * pp`` (a chunk would hold no block)."""
    import vitp.deepspeed_adapter as ds

    if depth < VIRTUAL * pp:
        raise ValueError(f"model.depth={depth} < {VIRTUAL} x pp={VIRTUAL * pp}: every virtual stage needs a block")
    return [int(x) for x in ds.partition_balanced(weights=[0] + [1] * depth + [0], num_parts=VIRTUAL * pp)]


# ----------------------------------------------------------------------------- variants

def _snapshot(named, grads: bool) -> dict:
    return {n: (p.grad if grads else p).detach().clone() for n, p in named if not grads or p.grad is not None}


class Recorder:
    """Parity records of one variant on this rank over its first :data:`PARITY_STEPS` steps:
    initial weights; at every optimizer step (``optimizer.step`` hooked until :meth:`finish`) the
    gradients before clipping and the global grad norm; the weights after the last of them."""

    def __init__(self, named_params, optimizer):
        self.named = list(named_params)
        self.init = _snapshot(self.named, grads=False)
        self.grads, self.norms, self.after = [], [], None
        self.opt, orig = optimizer, optimizer.step

        def recorded_step(closure=None):
            from vitp.parallel.grads import global_grad_norm

            self.grads.append(_snapshot(self.named, grads=True))
            self.norms.append(global_grad_norm([p for _, p in self.named], 0))  # all-reduced over the pp ranks
            return orig(closure)

        optimizer.step = recorded_step

    def finish(self) -> None:
        del self.opt.step  # back to the class's step
        self.after = _snapshot(self.named, grads=False)


def deepspeed_variant(cfg, run_dir: str):
    """(a) vitp's step: ``Trainer(cfg, run_dir).engine.train_batch`` on the first step's
    micro-batches, repeated. Returns ``(Variant, Recorder, trainer, micro-batches)``; a micro-batch
    is DeepSpeed's pipeline pair ``((z_t, t, y), (x, z_t, t))`` with ``z_t, x`` of shape
    ``(b, C, H, W)`` (or ``(b, C, T, H, W)``), ``t (b,)`` float, ``y (b,)`` class labels."""
    import itertools

    from vitp.train import Trainer
    from vitp.train.engine import ExactClipAdamW

    tr = Trainer(cfg, run_dir)
    micro = [next(tr.data_iter) for _ in range(tr.engine.gradient_accumulation_steps())]
    data = itertools.cycle(micro)
    if not isinstance(tr.engine.optimizer, ExactClipAdamW):
        raise RuntimeError(f"expected vitp's ExactClipAdamW as the engine's optimizer, got {type(tr.engine.optimizer)}")
    rec = Recorder(tr.engine.module.named_parameters(), tr.engine.optimizer)
    v = Variant(NAMES[0], lambda: float(tr.engine.train_batch(data_iter=data)))
    v.tidy = tr.loss_fn.pop_records  # the loss keeps per-sample records; the trainer pops them when it logs
    return v, rec, tr, micro


def pack_targets(x, z_t, t):
    """One tensor ``(b, 2 P + 1)`` of the loss's targets ``x, z_t`` (``(b, ...)``, ``P`` values per
    sample) and ``t (b,)``, in that order along dim 1 (unpacked by :func:`torch_variant`'s loss)."""
    import torch

    return torch.cat([x.reshape(len(x), -1), z_t.reshape(len(z_t), -1), t.reshape(-1, 1).to(x.dtype)], dim=1)


def torch_variant(name: str, cfg, micro, chunks: dict, interleaved: bool):
    """(b) or (c): ``torch.distributed.pipelining`` stages of this rank's ``chunks`` (``{stage
    index: {layer index: layer}}``, ``len(chunks) * pp`` stages in all) run by ``Schedule1F1B``
    (one stage) or ``ScheduleInterleaved1F1B`` (several), ``scale_grads=True``, on the pre-split
    micro-batches ``micro`` (``arg_mbs`` on the rank of stage 0, ``target_mbs`` on the rank of the
    last stage; the targets ``(x, z_t, t)`` packed into one tensor, :func:`pack_targets`, since
    torch's stages infer the backward's metadata from one target tensor); then the mean loss
    broadcast from the last stage's rank and vitp's optimizer step (:class:`ExactClipAdamW`,
    the squared grad norm all-reduced over the pp ranks). Returns ``(Variant, Recorder)``."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from vitp.objectives import FlowMatchingLoss
    from vitp.train.engine import ExactClipAdamW, param_groups

    pp, rank, m = tdist.get_world_size(), tdist.get_rank(), len(micro)
    n_stages = len(chunks) * pp
    mods = {s: chunk_module(layers) for s, layers in sorted(chunks.items())}
    stages = [PipelineStage(mod, s, n_stages, torch.device("cpu")) for s, mod in mods.items()]
    loss = FlowMatchingLoss(cfg.objective.t_eps)
    shape = micro[0][1][0].shape[1:]  # of x, z_t per sample

    def loss_fn(x_pred, packed):  # torch's stages take one target tensor (backward metadata inference)
        n = packed.shape[1] // 2
        x, z_t = (packed[:, i * n:(i + 1) * n].reshape(-1, *shape) for i in (0, 1))
        return loss(x_pred, (x, z_t, packed[:, 2 * n]))

    if interleaved:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=True)
    else:
        (stage,) = stages
        sched = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=True)
    whole = torch.nn.ModuleList(mods.values())
    o = cfg.optim
    opt = ExactClipAdamW(param_groups(whole, o.weight_decay), max_norm=o.grad_clip, tp_rank=0,
                         model_parallel_group=None, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    named = [(n, p) for mod in mods.values() for n, p in mod.named_parameters()]  # "<layer index>.<name>"
    rec = Recorder(named, opt)
    first, last = 0 in mods, n_stages - 1 in mods
    kw = {}
    if first:
        kw["arg_mbs"] = [tuple(inputs) for inputs, _ in micro]
    if last:
        kw["target_mbs"] = [pack_targets(*targets) for _, targets in micro]
    last_rank = pp - 1

    def step():
        losses = [] if last else None
        sched.step(**kw, losses=losses, return_outputs=False)  # DeepSpeed keeps no merged output either
        mean = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        tdist.broadcast(mean, src=last_rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(mean)

    v = Variant(name, step)
    v.tidy = loss.pop_records
    return v, rec


# ----------------------------------------------------------------------------- timing and parity

def time_variants(variants, reps: int, steps: int) -> dict:
    """``reps`` repetitions of ``steps`` timed steps of each variant in turn (order rotated each
    repetition), a barrier before each; ``{name: [per-repetition median of the step seconds,
    a step's time being its maximum over ranks]}``."""
    import torch.distributed as tdist

    from vitp.parallel import distributed as dist

    raw = {v.name: [] for v in variants}
    for r in range(reps):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            ts = []
            for _ in range(steps):
                tdist.barrier()
                t0 = time.perf_counter()
                v.step()
                ts.append(time.perf_counter() - t0)
                v.tidy()
            raw[v.name].append(ts)
    every = dist.gather_objects(raw)
    return {n: [statistics.median(max(rk[n][i][j] for rk in every) for j in range(steps)) for i in range(reps)]
            for n in raw}


def _max_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        raise RuntimeError(f"parameter names differ: {sorted(set(a) ^ set(b))[:6]}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _gather_kind(recs: dict, kind: str):
    """``{variant: {parameter name: tensor}}`` of one record kind of every rank, on rank 0 (else None)."""
    import torch.distributed as tdist

    out = [None] * tdist.get_world_size() if tdist.get_rank() == 0 else None
    pick = (lambda r: r.grads[int(kind.split(".")[1])]) if kind.startswith("grads.") else (lambda r: getattr(r, kind))
    tdist.gather_object({n: pick(r) for n, r in recs.items()}, out, dst=0)
    if out is None:
        return None
    merged = {n: {} for n in recs}
    for rk in out:
        for n, d in rk.items():
            dup = set(merged[n]) & set(d)
            if dup:
                raise RuntimeError(f"{n}: parameters on two ranks: {sorted(dup)[:4]}")
            merged[n].update(d)
    return merged


def parity(recs: dict, losses: dict) -> dict:
    """Differences of every variant's records (:class:`Recorder`) to (a)'s, gathered on rank 0 one
    kind at a time (the large model's weights are ~64 MB per copy): max abs difference of the
    initial weights, per step of the gradients before clipping (with (a)'s largest gradient and how
    many parameters have a non-zero gradient: at step 1 only the zero-initialised output layer
    does, adaLN-zero), relative difference of the grad norm and of the loss, and max abs difference
    of the weights after the last step. ``{}`` on the other ranks."""
    import torch.distributed as tdist

    if tdist.get_rank() != 0:
        for kind in ("init", *(f"grads.{i}" for i in range(PARITY_STEPS)), "after"):
            _gather_kind(recs, kind)
        return {}
    a0 = NAMES[0]
    res = {n: {"losses": losses[n], "grad_norms": recs[n].norms} for n in recs}
    for n in NAMES[1:]:
        res[n]["steps"] = [{"loss_rel_diff": abs(losses[n][i] - losses[a0][i]) / abs(losses[a0][i]),
                            "grad_norm_rel_diff": abs(recs[n].norms[i] - recs[a0].norms[i]) / recs[a0].norms[i]}
                           for i in range(PARITY_STEPS)]
    for kind in ("init", *(f"grads.{i}" for i in range(PARITY_STEPS)), "after"):
        merged = _gather_kind(recs, kind)
        a = merged[a0]
        for n in NAMES[1:]:
            row = res[n]
            if kind == "init":
                row["params"] = len(merged[n])
                row["init_weights_max_abs_diff"] = _max_diff(merged[n], a)
            elif kind == "after":
                row["weights_after_max_abs_diff"] = _max_diff(merged[n], a)
            else:
                st = row["steps"][int(kind.split(".")[1])]
                st["grads_max_abs_diff"] = _max_diff(merged[n], a)
                st["grad_max_abs"] = max(float(g.abs().max()) for g in a.values())
                st["params_nonzero_grad"] = sum(1 for g in a.values() if bool(g.any()))
        del merged, a
    return res


def _summary(times: dict) -> dict:
    base = times[NAMES[0]]
    out = {}
    for n, ts in times.items():
        rs = [x / y for x, y in zip(ts, base)]
        out[n] = {"step_ms": round(1e3 * statistics.median(ts), 2), "step_ms_min": round(1e3 * min(ts), 2),
                  "step_ms_max": round(1e3 * max(ts), 2), "ratio": round(statistics.median(rs), 4),
                  "ratio_min": round(min(rs), 4), "ratio_max": round(max(rs), 4)}
    return out


def schedule_worker(size: str, extra, micro_counts, reps: int, steps: int, tmp: str) -> dict:
    """One rank of the measurement (module docstring): for each ``m`` in ``micro_counts`` the
    three variants, interleaved; rank 0 returns the results (times in ms), the others ``{}``."""
    import torch.distributed as tdist

    from vitp.parallel import distributed as dist

    results = {}
    for m in micro_counts:
        base = compose(size, extra)
        pp = int(os.environ["WORLD_SIZE"])  # every rank is a pipeline stage
        gb = base.trainer.global_batch_size
        if gb % m:
            raise ValueError(f"global batch {gb} is not divisible into {m} micro-batches")
        cfg = compose(size, [*extra, f"parallel.pp={pp}", f"trainer.micro_batch_size={gb // m}"])
        a, rec_a, tr, micro = deepspeed_variant(cfg, f"{tmp}/sched-{size}-{pp}-{m}")
        rank = tdist.get_rank()
        parts = [int(x) for x in tr.engine.module.parts]
        b, rec_b = torch_variant(NAMES[1], cfg, micro, {rank: build_layers(cfg, range(parts[rank], parts[rank + 1]))},
                                 interleaved=False)
        iparts = interleaved_parts(cfg.model.depth, pp)
        mine = (rank, rank + pp)
        c, rec_c = torch_variant(NAMES[2], cfg, micro,
                                 {s: build_layers(cfg, range(iparts[s], iparts[s + 1])) for s in mine},
                                 interleaved=True)
        variants, recs = [a, b, c], {NAMES[0]: rec_a, NAMES[1]: rec_b, NAMES[2]: rec_c}
        losses = {}
        for v in variants:  # PARITY_STEPS untimed steps of each (the parity records; warm-up)
            tdist.barrier()
            losses[v.name] = []
            for _ in range(PARITY_STEPS):
                losses[v.name].append(v.step())
                v.tidy()
            v.first_loss = losses[v.name][0]
            recs[v.name].finish()
        par = parity(recs, losses)
        times = time_variants(variants, reps, steps)
        tdist.barrier()
        if dist.is_main():
            blocks = lambda lo, hi: sum(1 for i in range(lo, hi) if 1 <= i <= cfg.model.depth)  # noqa: E731
            results[str(m)] = {
                "micro_batch_size": gb // m,
                "layers_per_rank": {NAMES[1]: [[parts[r], parts[r + 1]] for r in range(pp)],
                                    NAMES[2]: [[[iparts[s], iparts[s + 1]] for s in (r, r + pp)] for r in range(pp)]},
                "blocks_per_rank": {NAMES[1]: [blocks(parts[r], parts[r + 1]) for r in range(pp)],
                                    NAMES[2]: [sum(blocks(iparts[s], iparts[s + 1]) for s in (r, r + pp))
                                               for r in range(pp)]},
                "first_loss": {v.name: v.first_loss for v in variants},
                "parity": par, "times": _summary(times)}
        if tr.batches is not None:
            tr.batches.close()  # the trainer's data loader
    if not dist.is_main():
        return {}
    return {"model": model_description(size, extra), "micro_batches": results}


# ----------------------------------------------------------------------------- report

def model_description(size: str, extra) -> dict:
    """The measured model's sizes (width, depth, heads, tokens ``N``, global batch, image ``CxHxW``)."""
    cfg = compose(size, extra)
    m, d = cfg.model, cfg.data
    from vitp.models import num_tokens
    from vitp.utils import to_dict

    return {"size": size, "width": m.width, "depth": m.depth, "heads": m.num_heads,
            "tokens": num_tokens(**to_dict(m)), "global_batch": cfg.trainer.global_batch_size,
            "image": f"{d.channels}x{d.resolution}x{d.resolution}", "precision": cfg.trainer.precision}


def markdown(res: dict) -> str:
    """The Markdown report of a result dict: one row per ``m`` and variant."""
    md = res["model"]
    lines = [f"`python scripts/bench_schedule.py {res['argv']}` ({res['when']}, {res['cores']} cores): pp={res['pp']}, "
             f"model width {md['width']}, depth {md['depth']}, {md['heads']} heads, {md['tokens']} tokens, global batch "
             f"{md['global_batch']}, {md['precision']}; {res['reps']} interleaved repetition(s) of {res['steps']} step(s); "
             "step = forward + backward of all micro-batches + loss broadcast + vitp's AdamW step with exact global "
             "grad-norm clipping; a step's time is its max over ranks; median over repetitions (min-max).", "",
             "| m | variant | step ms median (min-max) | ratio to (a) (min-max) | first loss |", "|---|---|---|---|---|"]
    for m, r in res["micro_batches"].items():
        for n in NAMES:
            t = r["times"][n]
            lines.append(f"| {m} | {LABELS[n]} | {t['step_ms']:.1f} ({t['step_ms_min']:.1f}-{t['step_ms_max']:.1f}) | "
                         f"{t['ratio']:.3f} ({t['ratio_min']:.3f}-{t['ratio_max']:.3f}) | {r['first_loss'][n]:.7g} |")
    lines += ["", f"Parity with (a) over the first {PARITY_STEPS} (untimed) steps: max abs difference over all parameters "
              "of the initial weights, per step of the gradients before clipping (in brackets: (a)'s largest "
              "gradient / parameters with a non-zero gradient), largest relative difference of the loss and of "
              f"the grad norm over the steps, weights after step {PARITY_STEPS}:", "",
              "| m | variant | blocks per rank | init weights | gradients per step | loss rel. diff | "
              "grad norm rel. diff | weights after |", "|---|---|---|---|---|---|---|---|"]
    for m, r in res["micro_batches"].items():
        for n in NAMES[1:]:
            p = r["parity"][n]
            grads = "; ".join(f"{st['grads_max_abs_diff']:.3g} ({st['grad_max_abs']:.3g} / {st['params_nonzero_grad']}"
                              f" of {p['params']})" for st in p["steps"])
            lines.append(f"| {m} | {LABELS[n]} | {r['blocks_per_rank'][n]} | {p['init_weights_max_abs_diff']:.3g} | "
                         f"{grads} | {max(st['loss_rel_diff'] for st in p['steps']):.3g} | "
                         f"{max(st['grad_norm_rel_diff'] for st in p['steps']):.3g} | "
                         f"{p['weights_after_max_abs_diff']:.3g} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes); default 2")
    p.add_argument("--micro-batches", default=None, help="comma-separated m (default 4,8; --quick 2,4)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per repetition (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny model (depth 2 pp), m = 2,4, 1 repetition (smoke test)")
    p.add_argument("--out", default=None, help="also write OUT.json and OUT.md")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.pp < 2:
        raise SystemExit("--pp must be at least 2")
    counts = [int(x) for x in (args.micro_batches or ("2,4" if args.quick else "4,8")).split(",")]
    reps = args.reps or (1 if args.quick else 5)
    size, extra = ("tiny", [f"model.depth={VIRTUAL * args.pp}"]) if args.quick else ("large", [])
    gb = int(next(o for o in SIZES[size] if o.startswith("trainer.global_batch_size=")).split("=")[1])
    bad = [m for m in counts if m < args.pp or gb % m]
    if bad:
        raise SystemExit(f"--micro-batches {bad}: each m must divide the global batch {gb} and be at least --pp "
                         f"{args.pp} (torch's Schedule1F1B requires m >= its number of stages)")
    with tempfile.TemporaryDirectory(prefix="vitp-bench-schedule-") as tmp:
        res = run_group(args.pp, schedule_worker, size, extra, counts, reps, args.steps, tmp)
    res = {"pp": args.pp, "model": res["model"], "quick": args.quick, "reps": reps, "steps": args.steps,
           "cores": len(os.sched_getaffinity(0)), "when": time.strftime("%Y-%m-%d %H:%M"),
           "argv": " ".join(sys.argv[1:] if argv is None else argv), "micro_batches": res["micro_batches"]}
    text = markdown(res)
    print(json.dumps(res, indent=1))
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
        Path(f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
