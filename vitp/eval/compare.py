"""One comparison of many evaluations: a table (CSV and Markdown) and a plot of sample accuracy
against the FD ratio, for ``vitp-sweep`` (:mod:`vitp.cli.sweep`).

A row is one evaluation (an ``eval.json``, :func:`vitp.eval.evaluate`) with a label, ``{key:
value}`` of the settings that tell it apart from the other rows: the swept keys of a sweep, or
for runs collected after the fact the config keys that differ from the first run's
(:func:`config_diff`). The metrics are copied from ``eval.json`` unchanged:

- ``sample_accuracy``: fraction of class-conditional samples the digits judge assigns to the
  requested class (digits only);
- ``fd_digits`` and ``fd_digits_ratio``: FD-digits of the samples and its ratio to the real
  held-out digits' FD-digits (1 = as close to the training digits as real held-out digits);
- ``heldout_loss``: the v-loss on the held-out split at the fixed ``t`` grid;
- ``temporal_diff_ratio``: video samples' frame-to-frame change over real clips' (video only);
- ``wall_s``: seconds of wall time (what it counts is set by the caller: the evaluation of a
  sampler setting, or a training run from its first to its last ``train.log`` line).

The target region drawn in the plot is issue 16's: ``sample_accuracy >= 0.99`` and
``fd_digits_ratio <= 2``.
"""
from __future__ import annotations

import csv
import datetime
import io
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from vitp.utils import atomic_write, atomic_write_text

# (column, meaning) of the metrics, in table order; columns that no row has are left out
METRICS = [
    ("sample_accuracy", "sample accuracy (judge)"),
    ("fd_digits", "FD-digits"),
    ("fd_digits_ratio", "FD-digits / real"),
    ("heldout_loss", "held-out loss"),
    ("temporal_diff_ratio", "temporal diff / real"),
    ("wall_s", "wall s"),
]
TARGET_ACCURACY, TARGET_FD_RATIO = 0.99, 2.0  # digits demo: accurate and varied samples
TARGET_TEMPORAL = (0.8, 1.3)  # video demo: neither frozen nor flickering, as real clips
# config keys that say where a run writes, not how it trains: never a label
_NOT_LABELS = ("paths.", "trainer.tensorboard_dir", "trainer.export_dir", "trainer.output_data_dir",
               "trainer.progress")
_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def read_eval(run_dir: Path) -> Dict[str, Any]:
    """The run's ``eval.json``. Raises ``FileNotFoundError`` naming the missing folder or file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist")
    path = run_dir / "eval.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: evaluate the run first (vitp-eval {run_dir})")
    return json.loads(path.read_text())


def log_wall_seconds(run_dir: Path) -> Optional[float]:
    """Seconds between the first and the last time-stamped line of ``run_dir/train.log`` (training,
    final samples and evaluation; not the process start-up), or ``None`` without such lines."""
    path = Path(run_dir) / "train.log"
    if not path.is_file():
        return None
    stamps = [m.group(1) for m in map(_LOG_TIME.match, path.read_text(errors="replace").splitlines()) if m]
    if not stamps:
        return None
    first, last = (datetime.datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1]))
    return (last - first).total_seconds()


def flatten(node: Any, prefix: str = "") -> Dict[str, Any]:
    """``{"a.b": leaf}`` of a nested dict; lists are leaves."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: Dict[str, Any] = {}
    for k, v in node.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def run_config(run_dir: Path) -> Dict[str, Any]:
    """The run's flattened ``.hydra/config.yaml`` with the sampler settings its ``eval.json``
    used (``vitp-eval RUN sampler.steps=50`` evaluates other settings than the config's).
    Raises ``FileNotFoundError`` when the run has no config or no ``eval.json``."""
    from omegaconf import OmegaConf

    from vitp.utils import recorded_config

    path = recorded_config(run_dir)
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    used = read_eval(run_dir).get("sampler")
    if isinstance(used, dict):
        cfg.setdefault("sampler", {}).update(used)
    return flatten(cfg)


def show(value: Any) -> str:
    """A config value as a table cell: lists and dicts as compact JSON, ``None`` as ``null``."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return "null" if value is None else str(value)


def config_diff(configs: Sequence[Dict[str, Any]]) -> List[Dict[str, str]]:
    """One label per flattened config: the keys whose value differs from the first config's in any
    config (keys under ``paths.`` and output folders excluded), in the first config's key order."""
    first = configs[0]
    keys = list(dict.fromkeys(k for c in configs for k in c))
    keys = [k for k in keys if not k.startswith(_NOT_LABELS)
            and any(c.get(k, "<unset>") != first.get(k, "<unset>") for c in configs)]
    return [{k: show(c.get(k, "<unset>")) for k in keys} for c in configs]


def make_row(label: Dict[str, str], result: Dict[str, Any], run: str, wall_s: Optional[float]) -> Dict[str, Any]:
    """A table row: the label's keys, the metrics of ``result`` (an ``eval.json``), ``wall_s`` and
    ``run`` (the folder of the evaluation)."""
    row: Dict[str, Any] = dict(label)
    for col, _ in METRICS:
        if col != "wall_s" and isinstance(result.get(col), (int, float)):
            row[col] = float(result[col])
    if wall_s is not None:
        row["wall_s"] = float(wall_s)
    row["run"] = run
    return row


def _order(value: Any) -> tuple:
    """Sort key of a cell: numbers (also numeric strings) by value before other text; empty cells last."""
    if value is None or value == "":
        return (2, 0.0, "")
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def sort_rows(rows: List[Dict[str, Any]], keys: Sequence[str], by: Optional[str] = None) -> List[Dict[str, Any]]:
    """Rows ordered by the label ``keys`` (numerically where the values are numbers), or by the
    column ``by`` (ascending; ``-col`` descending; rows without it last). Raises ``ValueError``
    for an unknown column."""
    if not by:
        return sorted(rows, key=lambda r: tuple(_order(r.get(k)) for k in keys))
    col, reverse = by.lstrip("-"), by.startswith("-")
    known = list(keys) + [c for c, _ in METRICS] + ["run"]
    if col not in known:
        raise ValueError(f"--sort {by}: unknown column; use one of {', '.join(known)} (prefix - for descending)")
    present = [r for r in rows if r.get(col) is not None]
    missing = [r for r in rows if r.get(col) is None]
    return sorted(present, key=lambda r: _order(r[col]), reverse=reverse) + missing


def columns(rows: Sequence[Dict[str, Any]], keys: Sequence[str]) -> List[str]:
    """The label keys, the metric columns some row has, then ``run``."""
    return list(keys) + [c for c, _ in METRICS if any(c in r for r in rows)] + ["run"]


def _cell(value: Any, col: str) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if col == "sample_accuracy" else f"{value:.4g}"
    return "" if value is None else str(value)


def _is_digits(row: Dict[str, Any]) -> bool:
    return row.get("sample_accuracy") is not None and row.get("fd_digits_ratio") is not None


def in_target(row: Dict[str, Any]) -> bool:
    """Whether a row meets the demos' target: accuracy >= 0.99 and FD ratio <= 2 (digits), or a
    temporal-diff ratio in [0.8, 1.3] (video, rows without the digits metrics)."""
    if _is_digits(row):
        return row["sample_accuracy"] >= TARGET_ACCURACY and row["fd_digits_ratio"] <= TARGET_FD_RATIO
    flicker = row.get("temporal_diff_ratio")
    return flicker is not None and TARGET_TEMPORAL[0] <= flicker <= TARGET_TEMPORAL[1]


def _target_text(rows: Sequence[Dict[str, Any]]) -> str:
    if any(_is_digits(r) for r in rows):
        return f"sample accuracy >= {TARGET_ACCURACY}, FD-digits ratio <= {TARGET_FD_RATIO}"
    return f"temporal diff / real in [{TARGET_TEMPORAL[0]}, {TARGET_TEMPORAL[1]}]"


def target_line(rows: Sequence[Dict[str, Any]]) -> str:
    """``Target (...): <runs meeting it>.``, judged by the table's one target (the digits one when
    any row has the digits metrics, :func:`_target_text`); runs lacking that target's metrics are
    named as having no such numbers, never as meeting it (a Wan run beside digits runs)."""
    digits = any(_is_digits(r) for r in rows)
    def has(r: Dict[str, Any]) -> bool:
        return _is_digits(r) if digits else r.get("temporal_diff_ratio") is not None

    hits = [r["run"] for r in rows if has(r) and in_target(r)]
    line = f"Target ({_target_text(rows)}): " + (", ".join(hits) if hits else "no row") + "."
    lacking = [str(r["run"]) for r in rows if not has(r)]
    if lacking:
        what = "sample accuracy / FD-digits ratio" if digits else "temporal diff / real"
        line += f" No {what} numbers, not judged: {', '.join(lacking)}."
    return line


def markdown(rows: Sequence[Dict[str, Any]], keys: Sequence[str], title: str) -> str:
    """The table as Markdown, with a title line and the rows that meet the target."""
    cols = columns(rows, keys)
    names = dict(METRICS)
    lines = [f"# {title}", "", "| " + " | ".join(names.get(c, c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(c), c).replace("|", "\\|") for c in cols) + " |" for r in rows]
    lines += ["", target_line(rows)]
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[Dict[str, Any]], keys: Sequence[str], path: Path) -> Path:
    """The table as CSV (full-precision floats, empty cells where a row lacks a metric)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns(rows, keys), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else repr(v) if isinstance(v, float) else v) for k, v in r.items()})
    return atomic_write_text(path, buf.getvalue())


def point_label(row: Dict[str, Any], keys: Sequence[str]) -> str:
    """``"cfg_scale=2 steps=20"``: the label keys shortened to their last part (when unambiguous)."""
    short = [k.rsplit(".", 1)[-1] for k in keys]
    names = short if len(set(short)) == len(short) else list(keys)
    return " ".join(f"{n}={row.get(k, '')}" for n, k in zip(names, keys)) or str(row.get("run", ""))


def plot(rows: Sequence[Dict[str, Any]], keys: Sequence[str], path: Path, title: str) -> Path:
    """``path`` (PNG, matplotlib's Agg backend): sample accuracy against the FD-digits ratio (log
    axis), each point labelled, issue 16's target region shaded. Rows without both metrics (other
    data than digits) give a bar chart of the held-out loss instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    pts = [r for r in rows if r.get("sample_accuracy") is not None and r.get("fd_digits_ratio") is not None]
    fig, ax = plt.subplots(figsize=(7.5, 5.5), dpi=100)
    if pts:
        xs = [max(r["fd_digits_ratio"], 1e-3) for r in pts]
        ys = [r["sample_accuracy"] for r in pts]
        lo, hi = min(min(xs), 1.0) / 1.5, max(max(xs), TARGET_FD_RATIO) * 4  # room for the labels
        ax.add_patch(Rectangle((lo, TARGET_ACCURACY), TARGET_FD_RATIO - lo, 1.02 - TARGET_ACCURACY,
                               color="tab:green", alpha=0.15, label="target: accuracy >= 0.99, FD ratio <= 2"))
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        for x, y, r in zip(xs, ys, pts):
            ax.annotate(point_label(r, keys), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(min(min(ys), TARGET_ACCURACY) - 0.02, 1.02)
        ax.set_xlabel("FD-digits / FD-digits of real held-out digits (log; lower is better)")
        ax.set_ylabel("sample accuracy (judge; higher is better)")
        ax.legend(loc="lower left", fontsize=8)
    else:
        losses = [(point_label(r, keys), r.get("heldout_loss", math.nan)) for r in rows]
        ax.barh([n for n, _ in losses], [v for _, v in losses], color="tab:blue")
        ax.set_xlabel("held-out loss (no sample accuracy / FD-digits for these data)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)


def write_comparison(rows: List[Dict[str, Any]], keys: Sequence[str], out_dir: Path, title: str,
                     sort: Optional[str] = None) -> Dict[str, Path]:
    """Sort ``rows`` (:func:`sort_rows`) and write ``out_dir/comparison.{csv,md,png}``; returns the
    paths by suffix. Raises ``ValueError`` when there is no row."""
    if not rows:
        raise ValueError(f"nothing to compare in {out_dir}: no evaluation finished")
    rows = sort_rows(rows, keys, sort)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"csv": write_csv(rows, keys, out_dir / "comparison.csv"),
            "md": atomic_write_text(out_dir / "comparison.md", markdown(rows, keys, title)),
            "png": plot(rows, keys, out_dir / "comparison.png", title)}
