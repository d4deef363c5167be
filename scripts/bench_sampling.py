"""Sampling split over processes: samples/s at 1, 2 and 4 processes over cp, tp and dp, with the
scaling efficiency, against one process running the whole generator.

    python scripts/bench_sampling.py --out sampling.json
    python scripts/bench_sampling.py --width 64 --depth 2 --num 4 --reps 1 --out f.json
    python scripts/bench_sampling.py --cli --steps 30 --reps 3 --out cli.json   # whole commands

With ``--cli`` it times whole commands instead, start-up and weight reads included: ``vitp-sample
WEIGHTS`` in one process against ``torchrun --nproc_per_node 2 vitp-sample WEIGHTS
parallel.cp=2``, interleaved ``--reps`` times, each process with ``OMP_NUM_THREADS=1``; it reports
each command's wall seconds (median, min-max), their ratio, and the largest pixel difference of the
two grids.

A ``--width`` x ``--depth`` generator at ``--resolution`` px (patch 2, 3 channels) with random
non-zero weights (adaLN gates included, so every path matters), ``--num`` class-conditional samples
with ``--steps`` Euler steps and classifier-free guidance at scale 2 (the conditional and
unconditional passes batched). Layouts: 1 process; 2 processes as cp=2, tp=2, dp=2; 4 processes as
cp=2 x dp=2, tp=2 x dp=2, dp=4. Every process runs with ``OMP_NUM_THREADS=1``; the layouts take
turns ``--reps`` times (interleaved). Timed on rank 0 between barriers: generation only (process
start, model build and weight reads excluded). Per layout: median and min-max samples/s, the
speedup over one process, the efficiency (speedup / processes) and the largest difference of its
samples from one process's (they must agree: same noise per sample index). On a machine with fewer
cores than processes the 4-process rows measure oversubscription, not scaling.
Writes JSON to ``--out`` and prints it.
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

LAYOUTS = {"1": (1, []), "cp2": (2, ["parallel.cp=2"]), "tp2": (2, ["parallel.tp=2"]), "dp2": (2, []),
           "cp2dp2": (4, ["parallel.cp=2"]), "tp2dp2": (4, ["parallel.tp=2"]), "dp4": (4, [])}


def _overrides(a: argparse.Namespace) -> list:
    return ["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_classes=4",
            f"data.resolution={a.resolution}", f"model.width={a.width}", f"model.depth={a.depth}", "model.num_heads=4",
            "model.patch_size=2", "trainer.device=cpu", "trainer.precision=fp32", f"trainer.micro_batch_size={a.num}",
            f"sampler.batch_size={a.num}", f"sampler.steps={a.steps}", "sampler.method=euler", "sampler.cfg_scale=2"]


def _weights(cfg, path: Path) -> None:
    import torch

    from vitp.checkpoint import save_export
    from vitp.models import Generator

    gen = Generator.from_config(cfg.model, seed=cfg.seed)
    g = torch.Generator().manual_seed(1234)
    save_export(path, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in gen.state_dict().items()}, cfg,
                step=0, weights="raw")


def _rank(rank: int, cfg_yaml: str, weights: str, num: int) -> dict:
    import torch
    from omegaconf import OmegaConf

    from vitp.eval import generate
    from vitp.eval.launch import build_sharded

    cfg = OmegaConf.create(cfg_yaml)
    sg = build_sharded(cfg, Path(weights))
    labels = torch.arange(num) % cfg.model.num_classes
    generate(sg.denoiser, cfg, labels[:1], seed=1)  # warm-up outside the timing (first-call allocations)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    x = generate(sg.denoiser, cfg, labels, seed=0, share=sg.share)
    torch.distributed.barrier()
    # numpy: a tensor would cross the queue as shared memory of a process about to exit
    return {"seconds": time.perf_counter() - t0, "samples": None if x is None else x.numpy()}


def _run(name: str, a: argparse.Namespace, weights: Path) -> dict:
    from omegaconf import OmegaConf

    from vitp.config import compose
    from vitp.parallel.local_group import run_local_group

    world, layout = LAYOUTS[name]
    cfg = compose([*_overrides(a), *layout])
    os.environ["OMP_NUM_THREADS"] = "1"
    return run_local_group(world, _rank, OmegaConf.to_yaml(cfg), str(weights), a.num, timeout=1800)[0]


def _summary(name: str, secs: list, base: float, a: argparse.Namespace, diff: float) -> dict:
    world = LAYOUTS[name][0]
    rates = [a.num / s for s in secs]
    med = statistics.median(rates)
    return {"layout": name, "processes": world, "samples_per_s": {"median": med, "min": min(rates), "max": max(rates),
                                                                  "n": len(rates)},
            "speedup": med / base, "efficiency": med / base / world, "max_abs_diff": diff}


def _command(weights: Path, out: Path, a: argparse.Namespace, world: int) -> list:
    sample = ["-m", "vitp.cli.sample", str(weights), f"cli.num={a.num // 4}", "cli.classes=[0,1,2,3]",
              f"cli.out={out}", "cli.force=true"]
    if world == 1:
        return [sys.executable, *sample]
    from vitp.utils import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
            str(free_port()), *sample, "parallel.cp=2"]


def _cli(a: argparse.Namespace, tmp: Path, weights: Path) -> dict:
    """Whole ``vitp-sample`` commands: one process against torchrun with 2 processes at cp=2."""
    import subprocess

    import numpy as np
    from PIL import Image

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    walls: dict = {1: [], 2: []}
    for _ in range(a.reps):
        for world in (1, 2):
            out = tmp / f"grid{world}.png"
            t0 = time.perf_counter()
            p = subprocess.run(_command(weights, out, a, world), env=env, capture_output=True, text=True)
            walls[world].append(time.perf_counter() - t0)
            if p.returncode:
                raise RuntimeError(f"exit {p.returncode}: {p.stderr[-3000:]}")
    grids = [np.asarray(Image.open(tmp / f"grid{w}.png")).astype(int) for w in (1, 2)]
    med = {w: statistics.median(v) for w, v in walls.items()}
    return {"one_process_s": {"median": med[1], "min": min(walls[1]), "max": max(walls[1]), "n": a.reps},
            "torchrun_cp2_s": {"median": med[2], "min": min(walls[2]), "max": max(walls[2]), "n": a.reps},
            "ratio": med[2] / med[1], "max_pixel_diff": int(np.abs(grids[0] - grids[1]).max())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--num", type=int, default=8, help="samples (divisible by 4)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cli", action="store_true", help="time whole vitp-sample commands (1 process vs torchrun cp=2)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    from vitp.config import compose

    secs, first = {n: [] for n in LAYOUTS}, {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.safetensors"
        _weights(compose(_overrides(a)), weights)
        if a.cli:
            out = {"model": {"width": a.width, "depth": a.depth, "resolution": a.resolution, "num": a.num,
                             "steps": a.steps}, "cpu_count": os.cpu_count(), "cli": _cli(a, Path(tmp), weights)}
            a.out.write_text(json.dumps(out, indent=1) + "\n")
            print(json.dumps(out, indent=1))
            return out
        for _ in range(a.reps):
            for name in LAYOUTS:
                r = _run(name, a, weights)
                secs[name].append(r["seconds"])
                first.setdefault(name, r["samples"])
    base = statistics.median(a.num / s for s in secs["1"])
    rows = [_summary(n, secs[n], base, a, float(abs(first[n] - first["1"]).max())) for n in LAYOUTS]
    out = {"model": {"width": a.width, "depth": a.depth, "resolution": a.resolution, "num": a.num, "steps": a.steps},
           "cpu_count": os.cpu_count(), "layouts": rows}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
