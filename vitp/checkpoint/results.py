"""A run directory's results, and moving them aside when a resume goes back before them.

A finished run ends by writing its results into the run directory: the exported weights
(``model_ema.safetensors`` / ``model.safetensors`` or their shards and ``.index.json``, each with
a ``.json`` sidecar recording the step), ``eval.json`` (``vitp-eval`` adds ``eval_*.json``) and
the final sample grid ``samples/step_N.png`` (``samples/step_N/`` with buckets or video). A
resume from a checkpoint earlier than the step they record (``trainer.resume=RUN/checkpoints/
step_M``: the latest is broken) would replace them at its own end with the results of another
step; :func:`set_aside_results` moves them first into ``checkpoints/abandoned/``, next to the
checkpoints such a resume abandons (:func:`vitp.checkpoint.training._rotate`), with copies of
``metrics.jsonl`` / ``eval.jsonl`` as they were. Nothing is deleted.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from vitp.utils import default_mode

log = logging.getLogger("vitp")

ABANDONED = "abandoned"  # checkpoints/abandoned/: checkpoints and results a resume from an older tag left behind
RESULT_PATTERNS = ("model_ema.safetensors", "model_ema-*-of-*.safetensors", "model_ema.safetensors.index.json",
                   "model_ema.json", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                   "model.json", "eval.json", "eval_*.json", "eval.npz", "eval_*.npz", "eval.npz.json")
LOGS = ("metrics.jsonl", "eval.jsonl")  # copied aside whole; the run's own copies drop the later rows
SAMPLE_GRID = re.compile(r"^step_(\d{7})(\.png)?$")  # samples/step_N.png, or samples/step_N/ (buckets, video)


def run_results(run_dir: Path) -> List[Path]:
    """The result files in ``run_dir`` (exported weights with their sidecars and indexes,
    ``eval.json``, ``eval_*.json``; not the sample grids, which are named by step), sorted."""
    found = {p for pattern in RESULT_PATTERNS for p in Path(run_dir).glob(pattern) if p.is_file()}
    return sorted(found)


def _recorded_step(path: Path) -> Optional[int]:
    try:
        step = json.loads(path.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and step >= 0 else None


def _last_logged_step(run_dir: Path) -> Optional[int]:
    path = run_dir / "metrics.jsonl"
    for line in reversed(path.read_text().splitlines() if path.is_file() else []):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut off by a crash
    return None


def results_step(run_dir: Path) -> Optional[int]:
    """The training step of the results in ``run_dir``: the newest step the weights' sidecars
    (``model_ema.json``, ``model.json``) and ``eval.json`` record, else (files written before the
    step was recorded) the last step in ``metrics.jsonl``; ``None`` without results."""
    run_dir = Path(run_dir)
    if not run_results(run_dir):
        return None
    steps = [s for s in (_recorded_step(run_dir / n) for n in ("model_ema.json", "model.json", "eval.json"))
             if s is not None]
    return max(steps) if steps else _last_logged_step(run_dir)


def file_step(run_dir: Path, path: Path) -> Optional[int]:
    """The training step a result file is of: what it records (``eval*.json``, the weights'
    sidecars), for weights files their sidecar's, for a FID sample file (``eval*.npz`` and its
    ``.npz.json``) its evaluation's; ``None`` when nothing says."""
    name = Path(path).name
    if name.startswith("model_ema"):
        return _recorded_step(run_dir / "model_ema.json")
    if name.startswith("model"):
        return _recorded_step(run_dir / "model.json")
    if ".npz" in name:
        return _recorded_step(run_dir / (name.split(".npz")[0] + ".json"))
    return _recorded_step(Path(path))


def _later(run_dir: Path, step: int) -> List[Path]:
    """The result files :func:`set_aside_results` moves when the run goes on from ``step``: all of
    them when the results are of a later step, but a file whose own step is ``step`` or earlier
    (``vitp-eval`` of an earlier checkpoint) stays."""
    found = results_step(run_dir)
    if found is None or found <= step:
        return []
    return [p for p in run_results(run_dir) if (found if (s := file_step(run_dir, p)) is None else s) > step]


def later_results(run_dir: Path, step: int) -> List[str]:
    """The names of the results :func:`set_aside_results` moves when the run goes on from ``step``
    (empty when its results are of ``step`` or earlier), for messages."""
    return [p.name for p in _later(run_dir, step)]


def later_grids(run_dir: Path, step: int) -> List[Path]:
    """The sample grids of steps after ``step`` (all of them from scratch: step 0 is redone too)."""
    step, samples = step if step else -1, run_dir / "samples"
    return sorted(p for p in (samples.iterdir() if samples.is_dir() else [])
                  if (m := SAMPLE_GRID.match(p.name)) and int(m.group(1)) > step)


def set_aside_results(run_dir: Path, start_step: int) -> Optional[Path]:
    """Before a run goes on from ``start_step`` (0: from scratch) in ``run_dir``: when its results
    are of a later step (:func:`results_step`), move them and the sample grids after
    ``start_step`` into ``run_dir/checkpoints/abandoned/<time>-results-step_N-<id>/``, copy
    ``metrics.jsonl`` and ``eval.jsonl`` there as they are, and log one warning naming what moved
    and where. Returns that folder, or ``None`` when nothing was later (nothing is touched)."""
    run_dir = Path(run_dir)
    step = results_step(run_dir)
    if step is None or step <= start_step:
        return None
    files, grids = _later(run_dir, start_step), later_grids(run_dir, start_step)
    aside = run_dir / "checkpoints" / ABANDONED
    aside.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-") + f"results-step_{step:07d}-", dir=aside))
    default_mode(dest)  # mkdtemp's 0700: others reading the run read what it set aside too
    for f in files:
        shutil.move(str(f), str(dest / f.name))
    if grids:
        (dest / "samples").mkdir()
    for g in grids:
        shutil.move(str(g), str(dest / "samples" / g.name))
    logs = [n for n in LOGS if (run_dir / n).is_file()]
    for n in logs:
        shutil.copy2(run_dir / n, dest / n)
    moved = [f.name for f in files] + [f"samples/{g.name}" for g in grids]
    copied = f"; copies of {' and '.join(logs)} as they were are there too" if logs else ""
    log.warning("moved %s to %s: results of step %d, later than step %d this run goes on from, which its own "
                "results would overwrite%s (delete the folder to free the space)", ", ".join(moved), dest, step,
                start_step, copied)
    return dest
