"""Whole ``vitp-sample`` commands of a run: one process against ``torchrun --nproc_per_node 2`` in the
layout vitp picks (no layout given: two replicas of the whole generator, :mod:`vitp.eval.launch`)
and with the run's layout forced (``parallel.cp=2``), as issue 54 timed them.

    python scripts/bench_sample.py --run RUN --num 16 --reps 3 --out bench.json
    python scripts/bench_sample.py --train /tmp/digits_cp2 --num 4     # trains the run first

``--train DIR`` trains the issue's digits run first (``parallel.cp=2`` on 2 processes, width 384,
depth 8, 6 heads, 4 steps: the weights' quality does not matter) unless ``DIR`` holds it. The
commands take turns ``--reps`` times (interleaved), every process with ``OMP_NUM_THREADS=1``
(torchrun's own default; one process would otherwise use every core), ``--num`` samples per class
of the 10 classes, Heun ``--steps`` steps, CFG ``--cfg``. Per command: wall seconds and CPU seconds
(user + sys of the whole process tree: ``getrusage(RUSAGE_CHILDREN)``, torchrun's agent included),
median and min-max, their ratio to one process's medians, the largest pixel difference of its grid
from one process's, and the 1-minute load average before each run (``/proc/loadavg``: other work
on the machine inflates both times). Writes JSON to ``--out`` and prints a table and the JSON.
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

BIN = Path(sys.executable).parent
COMMANDS = {"one process": (1, []), "torchrun 2, default": (2, []), "torchrun 2, parallel.cp=2": (2, ["parallel.cp=2"])}
TRAIN = ["parallel.cp=2", "model.width=384", "model.depth=8", "model.num_heads=6", "trainer.max_steps=4",
         "trainer.sample_every=0", "trainer.eval_every=0", "eval.enabled=false"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "NO_ALBUMENTATIONS_UPDATE": "1"}


def train(folder: Path) -> Path:
    """The issue's digits run in ``folder/run`` (trained on 2 processes at cp=2 unless it is there)."""
    run = folder / "run"
    if not (run / "model_ema.safetensors").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--no-python", str(BIN / "vitp-train"),
                            *TRAIN, f"hydra.run.dir={run}"], env=_env(), capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"training failed (exit {p.returncode}): {p.stderr[-3000:]}")
    return run


def command(run: Path, out: Path, a: argparse.Namespace, world: int, layout: list) -> list:
    """The ``vitp-sample`` command line (flags as overrides, as a launcher needs them)."""
    sample = [str(BIN / "vitp-sample"), str(run), f"cli.num={a.num}", f"cli.out={out}", "cli.force=true",
              "sampler.method=heun", f"sampler.steps={a.steps}", f"sampler.cfg_scale={a.cfg}", *layout]
    if world == 1:
        return sample
    from vitp.utils import free_port

    return [str(BIN / "torchrun"), "--nproc_per_node", str(world), "--master_port", str(free_port()), "--no-python",
            *sample]


def timed(cmd: list) -> tuple:
    """``(wall s, CPU s of the process tree)`` of running ``cmd``. Raises ``RuntimeError`` on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _stats(v: list) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def bench(run: Path, a: argparse.Namespace, tmp: Path) -> dict:
    """Interleaved repetitions of :data:`COMMANDS`; see the module doc."""
    import numpy as np
    from PIL import Image

    times: dict = {name: {"wall_s": [], "cpu_s": [], "load1": []} for name in COMMANDS}
    for _ in range(a.reps):
        for i, (name, (world, layout)) in enumerate(COMMANDS.items()):
            times[name]["load1"].append(float(Path("/proc/loadavg").read_text().split()[0]))
            wall, cpu = timed(command(run, tmp / f"grid{i}.png", a, world, layout))
            times[name]["wall_s"].append(wall)
            times[name]["cpu_s"].append(cpu)
    grids = [np.asarray(Image.open(tmp / f"grid{i}.png")).astype(int) for i in range(len(COMMANDS))]
    one = {k: statistics.median(times["one process"][k]) for k in ("wall_s", "cpu_s")}
    rows = []
    for i, (name, t) in enumerate(times.items()):
        wall, cpu = _stats(t["wall_s"]), _stats(t["cpu_s"])
        rows.append({"command": name, "wall_s": wall, "cpu_s": cpu, "wall_ratio": wall["median"] / one["wall_s"],
                     "cpu_ratio": cpu["median"] / one["cpu_s"], "load1": t["load1"],
                     "max_pixel_diff": int(np.abs(grids[i] - grids[0]).max())})
    return {"run": str(run), "samples": 10 * a.num, "steps": a.steps, "method": "heun", "cfg_scale": a.cfg,
            "reps": a.reps, "cores": os.cpu_count(), "commands": rows}


def table(res: dict) -> str:
    lines = [f"{res['samples']} samples, Heun {res['steps']} steps, CFG {res['cfg_scale']:g}, {res['reps']} "
             f"interleaved reps, {res['cores']} cores, OMP_NUM_THREADS=1",
             f"{'command':28} {'wall s (min-max)':>22} {'CPU s (min-max)':>22} {'wall x':>7} {'CPU x':>7} {'px':>3}"]
    for r in res["commands"]:
        w, c = r["wall_s"], r["cpu_s"]
        lines.append(f"{r['command']:28} {w['median']:8.1f} ({w['min']:5.1f}-{w['max']:5.1f}) "
                     f"{c['median']:8.1f} ({c['min']:5.1f}-{c['max']:5.1f}) {r['wall_ratio']:7.2f} "
                     f"{r['cpu_ratio']:7.2f} {r['max_pixel_diff']:3d}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="a trained run directory")
    src.add_argument("--train", type=Path, help="a folder for the issue's digits run (trained if absent)")
    p.add_argument("--num", type=int, default=16, help="samples per class (10 classes)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg", type=float, default=1.5, help="classifier-free guidance scale")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    run = a.run or train(a.train)
    with tempfile.TemporaryDirectory() as tmp:
        res = bench(run, a, Path(tmp))
    print(table(res))
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
