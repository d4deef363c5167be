#!/usr/bin/env python
"""Predicted vs measured step time of several layouts on this machine (CPU, gloo), and how well
``vitp-plan`` orders them.

    python scripts/plan_step_order.py [--world 4] [--steps 8] [--warmup 3] [--rounds 3] [hydra overrides]

Starts ``--world`` local ranks once (one thread each, as the launchers here set
``OMP_NUM_THREADS=1``; imports paid once); every rank then builds the real trainer for each
layout (``tp x pp x dp``, SP, activation checkpointing) on synthetic data and times
``Trainer.train_step`` (the DeepSpeed 1F1B step plus the EMA update) after ``--warmup`` steps.
Layouts are measured in ``--rounds`` interleaved rounds and each keeps its fastest median, so a
burst of load from other processes on the machine hits one round, not one layout. The
prediction is :func:`vitp.plan.predict` on the measured ``cpu`` profile
(:func:`vitp.plan.cpu_profile`, cached). Prints a table and the rank correlations (Spearman,
Kendall) between the measured and predicted orderings as JSON.
"""
import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the ranks
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

MODEL = ["experiment=smoke", "data.resolution=16", "data.channels=3", "data.num_classes=10", "model.width=128",
         "model.depth=4", "model.num_heads=4", "model.mlp_ratio=4", "trainer.global_batch_size=32",
         "trainer.micro_batch_size=4"]
LAYOUTS = {  # name: (tp, pp, sp, ac)
    "1x1x4": (1, 1, False, 0), "1x1x4 ac1": (1, 1, False, 1), "2x1x2": (2, 1, False, 0),
    "2x1x2 sp": (2, 1, True, 0), "1x2x2": (1, 2, False, 0), "2x2x1": (2, 2, False, 0),
    "4x1x1": (4, 1, False, 0), "1x4x1": (1, 4, False, 0),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per layout and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each layout keeps its fastest")
    p.add_argument("--layouts", nargs="*", default=None, help=f"subset of {list(LAYOUTS)}")
    return p.parse_known_args()


def _time_jobs(rank: int, jobs: list, steps: int, warmup: int, base: str) -> dict:
    """``{name: [median seconds of Trainer.train_step after warmup, per occurrence]}`` on this rank."""
    import statistics
    import time

    import torch
    from tqdm import tqdm

    from vitp.config import compose
    from vitp.train import Trainer

    out = {}
    for i, (name, over) in enumerate(jobs):
        cfg = compose(["data=synthetic", "eval.enabled=false", "trainer.eval_every=0", "trainer.sample_every=0",
                       "trainer.checkpoint_every=0", "trainer.log_every=100000", "trainer.max_steps=100000",
                       "trainer.progress=false", *over])
        tr = Trainer(cfg, f"{base}/{i}")
        tr.bar, tr._t_log, tr._n_log = tqdm(disable=True), time.perf_counter(), 0  # as Trainer.fit sets them
        times = []
        for step in range(1, warmup + steps + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            tr.train_step(step)
            times.append(time.perf_counter() - start)
        tr.batches.close()
        tr.logger.close()
        tr.lock.release()
        out.setdefault(name, []).append(statistics.median(times[warmup:]))
    return out


def measure(jobs: list, world: int, steps: int, warmup: int) -> dict:
    """``{name: [median step seconds per occurrence]}`` of rank 0, for ``jobs`` run by ``world`` ranks."""
    import tempfile

    from vitp.parallel.local_group import run_local_group

    base = tempfile.mkdtemp(prefix="vitp-order-")
    return run_local_group(world, _time_jobs, jobs, steps, warmup, base, timeout=7200,
                           preload=["torch", "deepspeed", "vitp.train"])[0]


def ranks(values: list) -> list:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r + 1
    return out


def correlations(a: list, b: list) -> dict:
    """Spearman's rho and Kendall's tau of two lists (no ties expected; ``None`` below 2 items)."""
    ra, rb, n = ranks(a), ranks(b), len(a)
    if n < 2:
        return {"spearman": None, "kendall": None}
    rho = 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    tau = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs) / len(pairs)
    return {"spearman": round(rho, 3), "kendall": round(tau, 3)}


def main() -> None:
    args, extra = parse_args()
    from vitp.config import compose
    from vitp.plan import cpu_profile, layout_of, predict

    prof = cpu_profile(threads=1, procs=args.world)
    names = args.layouts or list(LAYOUTS)
    over = {}
    for name in names:
        tp, pp, sp, ac = LAYOUTS[name]
        over[name] = [*MODEL, *extra, f"parallel.tp={tp}", f"parallel.pp={pp}",
                      f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.activation_checkpoint_interval={ac}"]
    times = measure([(n, over[n]) for _ in range(args.rounds) for n in names], args.world, args.steps, args.warmup)
    rows = []
    for name in names:
        cfg = compose(["data=synthetic", *over[name]])
        pred = predict(cfg.model, layout_of(cfg, args.world), prof)
        rows.append({"layout": name, "measured_s": round(min(times[name]), 4), "rounds_s": [round(t, 4) for t in
                     times[name]], "predicted_s": round(pred.time["step_s"], 4)})
    meas, pred = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    for r, rm, rp in zip(rows, ranks(meas), ranks(pred)):
        r.update(rank_measured=rm, rank_predicted=rp)
    print(json.dumps({"world": args.world, "profile": prof.as_dict(), "rows": rows, **correlations(meas, pred)},
                     indent=1))

if __name__ == "__main__":
    main()
