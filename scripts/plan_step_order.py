#!/usr/bin/env python
"""Predicted vs measured step time of several layouts on this machine (CPU, gloo), and how well
``vitp-plan`` orders them.

    python scripts/plan_step_order.py [--world 4] [--steps 12] [--warmup 4] [hydra overrides]

For each layout (``tp x pp x dp``, SP, activation checkpointing) of ``--world`` processes, runs
``scripts/benchmark_train.py`` on synthetic data as that many local ranks (one thread each, as
the launchers here set ``OMP_NUM_THREADS=1``), takes its median step time, and compares it with
:func:`vitp.plan.predict` on the measured ``cpu`` profile (:func:`vitp.plan.cpu_profile`, cached).
Prints a table and the rank correlations (Spearman, Kendall) between the two orderings as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--layouts", nargs="*", default=None, help=f"subset of {list(LAYOUTS)}")
    return p.parse_known_args()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(overrides: list, world: int, steps: int, warmup: int) -> float:
    """Median step time (s) of ``scripts/benchmark_train.py`` run as ``world`` local ranks."""
    port, procs = _port(), []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   NO_ALBUMENTATIONS_UPDATE="1")
        procs.append(subprocess.Popen([sys.executable, "scripts/benchmark_train.py", *overrides, "--steps", str(steps),
                                       "--warmup", str(warmup)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"benchmark failed for {overrides}:\n{outs[0][-3000:]}")
    line = next(x for x in outs[0].splitlines() if x.startswith("{") and "step_time_s" in x)
    return json.loads(line)["step_time_s"]


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
    rows = []
    for name in args.layouts or LAYOUTS:
        tp, pp, sp, ac = LAYOUTS[name]
        over = [*MODEL, *extra, f"parallel.tp={tp}", f"parallel.pp={pp}",
                f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.activation_checkpoint_interval={ac}"]
        cfg = compose(["data=synthetic", *over])
        pred = predict(cfg.model, layout_of(cfg, args.world), prof)
        rows.append({"layout": name, "measured_s": measure(over, args.world, args.steps, args.warmup),
                     "predicted_s": round(pred.time["step_s"], 4)})
        print(json.dumps(rows[-1]), flush=True)
    meas, pred = [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows]
    for r, rm, rp in zip(rows, ranks(meas), ranks(pred)):
        r.update(rank_measured=rm, rank_predicted=rp)
    print(json.dumps({"world": args.world, "profile": prof.as_dict(), "rows": rows, **correlations(meas, pred)},
                     indent=1))


if __name__ == "__main__":
    main()
