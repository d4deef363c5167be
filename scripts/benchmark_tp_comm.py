#!/usr/bin/env python
"""Tensor-parallel communication of one training micro-batch, measured against theory.

    torchrun --nproc_per_node 2 scripts/benchmark_tp_comm.py [--sp [off|on|both]] [--batch 8] [--partial-sync P[,P...]] [overrides]

Builds the generator from the composed config (default: the digits demo model), shards it over
all processes (tp = world size), runs one forward/backward under :class:`CommRecorder` and
prints, on rank 0, each kind of collective with its count and bytes next to the theory of
Korthikanti et al. 2022: per block and micro-batch 2 all-reduces of B*N*D elements forward and
2 backward without sequence parallelism; with it the same bytes as all-gathers and
reduce-scatters, plus (SP) the column-parallel inputs all-gathered again in backward instead
of saved, as Megatron-LM does. Also prints per-rank wire bytes, the wall time of the step, and for each
theory entry the relative error of the measured bytes and whether it is within ``--rtol``.
Several cases in one launch (``--sp both``, ``--partial-sync 1,0.5``: every combination) print one
JSON object each, in that order.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="sequence parallel (--sp alone: on; both: a case without and one with)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance of measured vs theory bytes")
    p.add_argument("--partial-sync", type=lambda v: [float(x) for x in v.split(",")], default=[1.0],
                   help="parallel.partial_sync p: only int(p*D) channels are summed (vitp.parallel.partial_sync); "
                        "a comma list measures each")
    return p.parse_known_args()


def build(cfg, sp: bool, partial_sync: float = 1.0):
    """The generator of ``cfg.model``, sharded over all processes (tp = world size)."""
    from vitp.models import Generator, parallelize_generator
    from vitp.parallel import distributed as dist
    from vitp.parallel import make_state

    if not torch.distributed.is_initialized():
        dist.init_distributed(dist.resolve_device("cpu"))
    tp = dist.world_size()
    gen = Generator.from_config(cfg.model, seed=cfg.seed)
    state = dataclasses.replace(make_state(tp=tp, sequence_parallel=sp), partial_sync=partial_sync)
    parallelize_generator(gen, state)
    return gen, tp


def theory_bytes(m, batch: int, tp: int, sp: bool, partial_sync: float = 1.0):
    """``(B*N*D fp32 bytes, {collective: bytes})`` of the block linears (tag ``tp``); with
    ``partial_sync = p < 1`` only ``int(p D)`` channels move, forward and backward, as an
    all-reduce or (SP) a reduce-scatter + all-gather, with no backward re-gather."""
    from vitp.models import num_tokens

    N = num_tokens(**m)
    n_pad = -(-N // tp) * tp if sp else N
    bnd = batch * n_pad * m.width * 4  # fp32 bytes of one (B, N, D) activation
    kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    theory = {f"{k}/{d}/tp": 2 * m.depth * bnd for d in ("fwd", "bwd") for k in kinds}
    if partial_sync < 1:
        k = int(m.width * partial_sync)
        return bnd, {key: v * k // m.width for key, v in theory.items()}
    if sp:  # the column-parallel inputs are gathered again in backward instead of saved (Megatron-LM)
        theory["all_gather/bwd/tp"] *= 2
    return bnd, theory


def compare(measured: dict, theory: dict, rtol: float) -> dict:
    """Relative error of the measured bytes per theory entry (1.0 when not measured at all)."""
    err = {k: abs(measured.get(k, {}).get("bytes", 0) - v) / v for k, v in theory.items()}
    return {"relative_error": err, "rtol": rtol, "within_rtol": all(e <= rtol for e in err.values())}


def main() -> None:
    args, overrides = parse_args()

    from vitp.config import compose

    cfg = compose(overrides)
    for sp in {"off": [False], "on": [True], "both": [False, True]}[args.sp]:
        for partial_sync in args.partial_sync:
            measure(cfg, args, sp, partial_sync)
    torch.distributed.destroy_process_group()


def measure(cfg, args, sp: bool, partial_sync: float) -> None:
    """One case: a forward/backward under :class:`CommRecorder`, rank 0 printing its JSON object."""
    from vitp.config import parse_resolution
    from vitp.models import num_tokens
    from vitp.parallel import CommRecorder
    from vitp.parallel import distributed as dist

    m = cfg.model
    gen, tp = build(cfg, sp, partial_sync)
    x = torch.randn(args.batch, m.in_channels, m.num_frames, *parse_resolution(m.image_size))
    t, y = torch.rand(args.batch), torch.randint(0, m.num_classes, (args.batch,))
    start = time.perf_counter()
    with CommRecorder() as rec:
        gen(x, t, y).pow(2).mean().backward()
    wall = time.perf_counter() - start
    if dist.is_main():
        bnd, theory = theory_bytes(m, args.batch, tp, sp, partial_sync)
        rows = {f"{k}/{d}/{tag}": v for (k, d, tag), v in sorted(rec.summary().items())}
        print(json.dumps({"tp": tp, "sequence_parallel": sp, "partial_sync": partial_sync,
                          "depth": m.depth, "tokens": num_tokens(**m),
                          "B*N*D_bytes": bnd, "measured": rows, "theory_block_linears": theory,
                          "wire_bytes_per_rank": rec.wire_bytes(), "step_wall_s": round(wall, 4),
                          **compare(rows, theory, args.rtol)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
