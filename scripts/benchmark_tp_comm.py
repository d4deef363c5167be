#!/usr/bin/env python
"""Tensor-parallel communication of one training micro-batch, measured against theory.

    torchrun --nproc_per_node 2 scripts/benchmark_tp_comm.py [--sp] [--batch 8] [hydra overrides]

Builds the generator from the composed config (default: the digits demo model), shards it over
all processes (tp = world size), runs one forward/backward under :class:`CommRecorder` and
prints, on rank 0, each kind of collective with its count and bytes next to the theory of
Korthikanti et al. 2022: per block and micro-batch 2 all-reduces of B*N*D elements forward and
2 backward without sequence parallelism; with it the same bytes as all-gathers and
reduce-scatters. Also prints per-rank wire bytes and the wall time of the step.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument("--batch", type=int, default=8)
    args, overrides = p.parse_known_args()

    from vitp import dist
    from vitp.config import compose
    from vitp.models import Generator, num_tokens
    from vitp.parallel import CommRecorder, make_state, tensor_parallelize

    cfg = compose(overrides)
    dist.init_distributed(dist.resolve_device("cpu"))
    tp = dist.world_size()
    m = cfg.model
    gen = Generator(m, seed=cfg.seed)
    state = make_state(tp=tp, sequence_parallel=args.sp)
    tensor_parallelize(gen, state)
    x = torch.randn(args.batch, m.in_channels, m.num_frames, m.image_size, m.image_size)
    t, y = torch.rand(args.batch), torch.randint(0, m.num_classes, (args.batch,))
    start = time.perf_counter()
    with CommRecorder() as rec:
        gen(x, t, y).pow(2).mean().backward()
    wall = time.perf_counter() - start
    if not dist.is_main():
        return
    N = num_tokens(m)
    n_pad = -(-N // tp) * tp if args.sp else N
    bnd = args.batch * n_pad * m.width * 4  # fp32 bytes of one (B, N, D) activation
    rows = {f"{k}/{d}/{tag}": v for (k, d, tag), v in sorted(rec.summary().items())}
    theory = ({"all_gather/fwd/tp": 2 * m.depth * bnd, "reduce_scatter/fwd/tp": 2 * m.depth * bnd,
               "all_gather/bwd/tp": 2 * m.depth * bnd, "reduce_scatter/bwd/tp": 2 * m.depth * bnd} if args.sp else
              {"all_reduce/fwd/tp": 2 * m.depth * bnd, "all_reduce/bwd/tp": 2 * m.depth * bnd})
    print(json.dumps({"tp": tp, "sequence_parallel": args.sp, "depth": m.depth, "tokens": N, "B*N*D_bytes": bnd,
                      "measured": rows, "theory_block_linears": theory,
                      "wire_bytes_per_rank": rec.wire_bytes(), "step_wall_s": round(wall, 4)}, indent=1))


if __name__ == "__main__":
    main()
