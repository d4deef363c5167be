"""Sharded, asynchronous checkpoints measured per rank: bytes written and read, peak memory, and
the training stall of an asynchronous save against a synchronous one.

    python scripts/bench_checkpoint.py --out ckpt.json            # 8 ranks tp2 x pp2 x dp2, ~26M params
    python scripts/bench_checkpoint.py --world 4 --reps 3 --out f.json

Layout part: ``--world`` ranks (tp=2 x pp=2 x dp=world/4; a world of 4: tp=2 x dp=2) train 4 steps of a ``--width`` x ``--depth``
generator (default 512 x 7, 26.3M parameters, fp32), saving every 2 steps in the background; every rank reports its peak RSS (VmHWM), the bytes of the files it wrote into the last
checkpoint and the bytes of its share of the state; then ``world/2`` ranks resume the step-2
checkpoint (dp halved) and report the bytes each read. Stall part: one process trains the same
model for 12 steps with a checkpoint every 4, ``--reps`` times asynchronous and synchronous
(``trainer.checkpoint_async``), interleaved; per save, the time training waited (median, min-max),
and each run's wall time.
Writes JSON to ``--out`` and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

BASE = ["experiment=smoke", "model.num_heads=8", "trainer.micro_batch_size=2", "trainer.eval_every=0",
        "trainer.sample_every=0", "trainer.keep_checkpoints=0"]


def _vm_hwm() -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rank(rank: int, over: list, run: str) -> dict:
    from vitp.config import compose
    from vitp.train import train

    res = train(compose(over), run)
    tag = max((Path(run) / "checkpoints").glob("step_*"))
    mine = [p for p in tag.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rng_rank{rank:05d}.pt"
            or rank == 0 and p.name in (".metadata", "vitp_meta.json")]
    return {"peak_bytes": _vm_hwm(), "written_bytes": sum(p.stat().st_size for p in mine), **res["checkpoint"]}


def _layout(world: int, model: list, tmp: Path) -> dict:
    from vitp.parallel.local_group import run_local_group

    pp = 2 if world % 8 == 0 else 1  # dp even, so that the resume can halve it
    over = [*model, "parallel.tp=2", f"parallel.pp={pp}", "trainer.max_steps=6", "trainer.checkpoint_every=2",
            "trainer.exit_at_step=4"]
    run = tmp / "layout" / "run"
    full = run_local_group(world, _rank, over, str(run), timeout=1800)
    back = tmp / "layout" / "back"
    shutil.copytree(run, back)
    shutil.rmtree(back / "checkpoints" / "step_0000004")
    (back / "checkpoints" / "latest").write_text("step_0000002")
    half = run_local_group(world // 2, _rank, over, str(back), timeout=1800)
    tag = run / "checkpoints" / "step_0000004"
    from vitp.config import compose
    from vitp.models import Generator
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in Generator.from_config(compose(model).model).parameters())
    written = [r["written_bytes"] for r in full]
    peaks = sorted(r["peak_bytes"] for r in full)
    return {"world": world, "tp": 2, "pp": pp, "dp": world // (2 * pp), "params": params, "state_once_bytes": 16 * params,
            "folder_bytes": sum(p.stat().st_size for p in tag.iterdir()),
            "written_bytes_per_rank": written, "busiest_over_mean": max(written) / statistics.mean(written),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in full],
            "peak_max_over_median": peaks[-1] / statistics.median(peaks),
            "share_bytes_per_rank": [r["share_bytes"] for r in full],
            "resume_ranks": world // 2, "resume_read_bytes_per_rank": [r["bytes_read"] for r in half],
            "resume_share_bytes_per_rank": [r["share_bytes"] for r in half],
            "resume_read_over_share": [r["bytes_read"] / r["share_bytes"] for r in half],
            "saves": full[0]["saves"]}


def _stall_rank(rank: int, over: list, run: str) -> dict:
    import time

    from vitp.config import compose
    from vitp.train import train

    t0 = time.perf_counter()
    saves = train(compose(over), run)["checkpoint"]["saves"]
    return {"saves": saves, "run_s": time.perf_counter() - t0}


def _stall(reps: int, model: list, tmp: Path) -> dict:
    """Per save, the seconds training waited, asynchronous and synchronous, and the whole run's
    wall time (the background write competes with training for the cores)."""
    from vitp.parallel.local_group import run_local_group

    out = {"async": [], "sync": []}
    runs = {"async": [], "sync": []}
    for r in range(reps):
        for mode in ("async", "sync"):
            # saves at steps 4, 8 and 12, four steps apart: a background write ends before the next
            over = [*model, "trainer.max_steps=13", "trainer.checkpoint_every=4", "trainer.exit_at_step=12",
                    f"trainer.checkpoint_async={mode == 'async'}"]
            res = run_local_group(1, _stall_rank, over, str(tmp / f"stall_{mode}_{r}"), timeout=1800)[0]
            out[mode] += [s["blocked_s"] for s in res["saves"]]
            runs[mode].append(res["run_s"])

    def stats(xs):
        return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}

    res = {k: stats(v) for k, v in out.items()}
    res["async_over_sync"] = res["async"]["median_s"] / res["sync"]["median_s"]
    res["run_wall"] = {k: stats(v) for k, v in runs.items()}
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8, help="ranks of the layout part (a multiple of 4; 8 or more: pp=2)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the stall part")
    p.add_argument("--width", type=int, default=512, help="model.width (8 heads)")
    p.add_argument("--depth", type=int, default=7, help="model.depth")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    model = [*BASE, f"model.width={a.width}", f"model.depth={a.depth}"]
    if a.world % 4:
        sys.exit("bench_checkpoint: --world must be a multiple of 4 (tp=2 x pp=2 x dp)")
    tmp = Path(tempfile.mkdtemp(prefix="vitp-bench-ckpt-"))
    try:
        res = {"layout": _layout(a.world, model, tmp), "stall": _stall(a.reps, model, tmp)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
