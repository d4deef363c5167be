#!/usr/bin/env python
"""Wall and CPU time of ``vitp-plan`` on the commands of issue 54 item 2, each a fresh process.

    python scripts/bench_plan.py [--repeats 3] [--case g8 --case g1024 ...] [--json]

Cases (``--case``, default all): ``g8`` ``vitp-plan --gpus 8 --device h100 experiment=img256``;
``g128`` / ``g1024`` the 32.7B DiT (``experiment=img256 model.width=6144 model.depth=48
model.num_heads=48``: 32.7B parameters, the header says so) on 128 / 1024 H100s, default table;
``g128_json`` the same with ``--top 0 --json`` (3,288 rows). Each runs ``--repeats`` times one
after the other; prints per case the median, min and max wall seconds and the median CPU seconds
(user + sys of the process, ``resource.getrusage(RUSAGE_CHILDREN)``), with the load average
before and after (the CPU time says more on a loaded machine), and the rows the command printed.
The process start (Python, Hydra, and torch, timm, DeepSpeed where imported) is included: it is
what a user waits for. Each case runs ``cold`` (every run with an empty ``VITP_CACHE_DIR``: the
model's facts computed, by arithmetic for vitp's generator, :mod:`vitp.plan.arith`, as on a machine
that never planned it) and ``warm`` (the facts kept by one untimed run before: :mod:`vitp.plan.facts`);
``--cache`` picks one.
``--json``: one JSON object instead of the table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIT33B = ["experiment=img256", "model.width=6144", "model.depth=48", "model.num_heads=48"]
CASES = {
    "g8": ["--gpus", "8", "--device", "h100", "experiment=img256"],
    "g128": ["--gpus", "128", "--device", "h100", *DIT33B],
    "g128_json": ["--gpus", "128", "--device", "h100", "--top", "0", "--json", *DIT33B],
    "g1024": ["--gpus", "1024", "--device", "h100", *DIT33B],
}


def run_once(argv: list, cache: str) -> dict:
    """One ``python -m vitp.cli.plan argv`` process with ``VITP_CACHE_DIR=cache``: ``{"wall_s",
    "cpu_s", "rows"}``; raises ``RuntimeError`` with its stderr when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "VITP_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "vitp.cli.plan", *argv], cwd=REPO, env=env, capture_output=True,
                       text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"vitp-plan {' '.join(argv)}: exit {p.returncode}\n{p.stderr[-3000:]}")
    if "--json" in argv:
        rows = len(json.loads(p.stdout)["layouts"])
    else:
        rows = sum(1 for line in p.stdout.splitlines() if line[:4].strip().isdigit() and "|" in line)
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "rows": rows}


def bench(name: str, repeats: int, cache: str) -> dict:
    """``repeats`` runs of case ``name`` with ``cache`` ``cold`` or ``warm`` facts: median / min /
    max wall seconds, median CPU seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        if cache == "warm":
            run_once(CASES[name], tmp)
        load = os.getloadavg()[0]
        runs = []
        for i in range(repeats):
            runs.append(run_once(CASES[name], tmp if cache == "warm" else os.path.join(tmp, f"cold{i}")))
    wall = [r["wall_s"] for r in runs]
    return {"case": name, "cache": cache, "command": "vitp-plan " + " ".join(CASES[name]), "repeats": repeats,
            "wall_median_s": statistics.median(wall), "wall_min_s": min(wall), "wall_max_s": max(wall),
            "cpu_median_s": statistics.median(r["cpu_s"] for r in runs), "rows": runs[0]["rows"],
            "load_before": load, "load_after": os.getloadavg()[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per case (default 3)")
    p.add_argument("--case", action="append", choices=list(CASES), help="a case to run (repeatable; default all)")
    p.add_argument("--cache", choices=["cold", "warm", "both"], default="both",
                   help="facts of the model not on disk (cold), on disk (warm), or both (default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    kinds = ["cold", "warm"] if args.cache == "both" else [args.cache]
    results = [bench(name, max(1, args.repeats), kind) for name in (args.case or list(CASES)) for kind in kinds]
    if args.json:
        print(json.dumps({"cpu_count": os.cpu_count(), "results": results}, indent=1))
        return
    print(f"{'case':10} {'facts':>5} {'rows':>6} {'wall median':>12} {'wall min..max':>16} {'CPU median':>11} {'load':>11}  command")
    for r in results:
        print(f"{r['case']:10} {r['cache']:>5} {r['rows']:>6} {r['wall_median_s']:>11.2f}s {r['wall_min_s']:>7.2f}..{r['wall_max_s']:<7.2f}s "
              f"{r['cpu_median_s']:>10.2f}s {r['load_before']:>5.1f}-{r['load_after']:<5.1f}  {r['command']}")


if __name__ == "__main__":
    main()
