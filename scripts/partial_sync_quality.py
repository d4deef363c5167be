"""Quality and step time of partial synchronization (``parallel.partial_sync``) on the demos at tp=2.

Runs ``torchrun --nproc_per_node 2 -m vitp.train parallel.tp=2 parallel.partial_sync=P`` one
after the other (same seed, data order and budget for every ``P``), then reads each run's
``eval.json`` and ``metrics.jsonl`` and writes ``quality.md`` / ``quality.json`` to ``--out``:
held-out loss, sample accuracy and FD-digits ratio (digits), the step time and its ratio to
``P = 1``, and the TP bytes per step (``comm/tp_bytes``). Run it on an otherwise idle machine.

    python scripts/partial_sync_quality.py --out runs/ps --digits-steps 3000 --video-steps 1200
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEMOS = {"digits": [], "video": ["experiment=video_demo"]}
KEYS = ("heldout_loss", "sample_accuracy", "fd_digits_ratio", "temporal_diff_ratio")


def _train(run_dir: Path, demo: str, p: float, steps: int, extra: list) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc_per_node", "2", "-m", "vitp.train", *DEMOS[demo], "parallel.tp=2",
           f"parallel.partial_sync={p}", f"trainer.max_steps={steps}", "trainer.progress=false",
           f"hydra.run.dir={run_dir}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def _summary(run_dir: Path, wall: float) -> dict:
    ev = json.loads((run_dir / "eval.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[len(rows) // 4:] or rows  # skip start-up
    sps = sum(r.get("samples_per_s", 0) for r in later) / len(later)
    out = {k: ev.get(k) for k in KEYS}
    out.update(wall_s=wall, samples_per_s=sps, tp_bytes=later[-1].get("comm/tp_bytes"), final_loss=rows[-1].get("loss"))
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _table(results: dict) -> str:
    """One Markdown table per demo; ratios are against the ``p = 1`` run of the same demo."""
    lines = []
    for demo, per_p in results.items():
        base = per_p.get("1.0", {})
        cols = ["sample_accuracy", "fd_digits_ratio"] if demo == "digits" else ["temporal_diff_ratio"]
        lines += [f"\n{demo} (tp=2, {next(iter(per_p.values()))['steps']} steps):\n",
                  "| p | held-out loss | " + " | ".join(cols)
                  + " | samples/s | step time vs p=1 | TP bytes/step vs p=1 |",
                  "|---" * (len(cols) + 5) + "|"]
        for p, r in per_p.items():
            ratio = base.get("samples_per_s", 0) / r["samples_per_s"] if r.get("samples_per_s") else float("nan")
            tb = r["tp_bytes"] / base["tp_bytes"] if base.get("tp_bytes") and r.get("tp_bytes") else float("nan")
            vals = " | ".join(_fmt(r.get(c)) for c in cols)
            lines.append(f"| {p} | {_fmt(r['heldout_loss'])} | {vals} | {r['samples_per_s']:.1f} | {ratio:.3f} | "
                         f"{tb:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/partial_sync"))
    ap.add_argument("--digits-steps", type=int, default=3000)
    ap.add_argument("--video-steps", type=int, default=1200)
    ap.add_argument("--demos", nargs="+", default=["digits", "video"], choices=list(DEMOS))
    ap.add_argument("--digits-p", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--video-p", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--tag", default="", help="label of these runs in the table (e.g. 'scale=none' with the "
                                              "override parallel.partial_sync_scale=none)")
    ap.add_argument("extra", nargs="*", help="more vitp-train overrides for every run")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = json.loads((a.out / "quality.json").read_text()) if (a.out / "quality.json").is_file() else {}
    for demo in a.demos:
        steps = a.digits_steps if demo == "digits" else a.video_steps
        for p in (a.digits_p if demo == "digits" else a.video_p):
            key = f"{p} {a.tag}".strip()
            run_dir = a.out / f"{demo}_p{p}{'_' + a.tag.replace('=', '_') if a.tag else ''}"
            wall = _train(run_dir, demo, p, steps, a.extra)
            results.setdefault(demo, {})[key] = {**_summary(run_dir, wall), "steps": steps}
            (a.out / "quality.json").write_text(json.dumps(results, indent=2))
            print(demo, key, results[demo][key], flush=True)
    (a.out / "quality.md").write_text(_table(results))
    print(_table(results))


if __name__ == "__main__":
    main()
