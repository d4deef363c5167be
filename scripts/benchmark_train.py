#!/usr/bin/env python
"""Training throughput and MFU on synthetic data (no files), for any recipe and layout.

    python scripts/benchmark_train.py experiment=smoke data.resolution=32 --steps 20
    deepspeed --num_gpus 8 scripts/benchmark_train.py experiment=img256 --peak-tflops 989

Prints one JSON line on rank 0: samples/s and step time (median over the steps after
``--warmup``), model FLOPs per sample (6 x forward matmul FLOPs + attention, as in the PaLM /
nanoGPT MFU estimate; :func:`vitp.plan.model_flops_per_step`, the count the training telemetry
uses) and MFU against ``--peak-tflops`` per process.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile

from vitp.models import num_tokens
from vitp.plan import model_flops_per_step


def flops_per_sample(m) -> float:
    """Training model FLOPs per sample (:func:`vitp.plan.model_flops_per_step`: 3 x forward;
    forward = 2 x the weights each token (or, for adaLN and the timestep MLP, each sample) meets
    + attention scores/values ``4 N S D`` per block, S = keys per query)."""
    return model_flops_per_step(m, 1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense TFLOP/s of one device (0: skip MFU)")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timing")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: trainer.max_steps of the config)")
    p.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory, removed)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_known_args()


def step_rates(run_dir: str, warmup: int) -> list:
    """``samples_per_s`` of every logged step after ``warmup`` (from ``run_dir/metrics.jsonl``)."""
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r["step"] > warmup]
    if not rates:
        raise SystemExit(f"no step after --warmup {warmup} was logged; raise trainer.max_steps / --steps")
    return rates


def report(cfg, sps: float, world: int, peak_tflops: float) -> dict:
    fps = flops_per_sample(cfg.model)
    out = {
        "samples_per_s": round(sps, 2),
        "step_time_s": round(cfg.trainer.global_batch_size / sps, 4),
        "tokens_per_sample": num_tokens(**cfg.model),
        "model_tflops_per_sample": fps / 1e12,
        "achieved_tflops_per_process": round(sps * fps / world / 1e12, 4),
        "world_size": world,
    }
    if peak_tflops:
        out["mfu"] = round(sps * fps / world / (peak_tflops * 1e12), 4)
    return out


def main() -> None:
    args, overrides = parse_args()

    from vitp.config import compose
    from vitp.parallel import distributed as dist
    from vitp.train import Trainer

    steps = [f"trainer.max_steps={args.steps}"] if args.steps is not None else []
    cfg = compose(["data=synthetic", "eval.enabled=false", "trainer.eval_every=0", "trainer.sample_every=0",
                   "trainer.log_every=1", "trainer.progress=false", *overrides, *steps])
    if dist.world_size() > 1:
        dist.init_distributed(dist.resolve_device(cfg.trainer.device))
    run_dir = args.run_dir or (tempfile.mkdtemp(prefix="vitp-bench-") if dist.is_main() else None)
    run_dir = dist.broadcast_object(run_dir)
    Trainer(cfg, run_dir).fit()
    if not dist.is_main():
        return
    rates = step_rates(run_dir, args.warmup)
    if args.run_dir is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(report(cfg, statistics.median(rates), dist.world_size(), args.peak_tflops)))


if __name__ == "__main__":
    main()
