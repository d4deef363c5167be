"""``vitp-sweep``: compare sampler settings on one trained run, or recipes across runs, in one table
(``comparison.csv``, ``comparison.md``) and one plot (``comparison.png``, sample accuracy against
the FD-digits ratio); see :mod:`vitp.eval.compare` for the columns.

The overrides are Hydra's, expanded by Hydra's own parser and basic sweeper exactly as
``vitp-train --multirun`` would (:func:`expand`): ``key=a,b,c``, ``key=choice(a,b)``,
``key=range(0,10,2)``, ``key=sort(...)``, ``group=glob(pattern)`` (config groups), and
``key=[0.1,1],[0,1]`` for two list values; ``interval(...)`` is refused (it has no values to list).

``vitp-sweep eval RUN_DIR [--name NAME] [--weights FILE] key=a,b ...``
    Loads the run's generator once and evaluates every combination (the cartesian product) with
    the code of ``vitp-eval``. Only evaluation keys may change (``sampler.*``, ``eval.*``,
    ``objective.noise_scale``, ``objective.t_eps``, ``trainer.device``). The run's own
    ``eval.json`` is left alone: each setting's goes to ``RUN_DIR/sweeps/NAME/NNN_<setting>/``.
``vitp-sweep train [--out DIR] key=a,b ... group=x,y ...``
    Runs ``vitp-train`` once per combination, one after another, each in ``DIR/NNN_<setting>/``
    with the same seeds and ``eval.enabled=true``; every combination is composed and checked
    before the first one trains, its layout against the processes each run gets (one ``python -m
    vitp.cli.train``: one process, or the launch's ``WORLD_SIZE``, :func:`run_world_size`). Run it again to finish an interrupted sweep: runs with an
    ``eval.json`` are kept, the others resume from their latest checkpoint.
``vitp-sweep collect DIR... [--out DIR]``
    The table of existing runs (a DIR that is not a run directory stands for the run directories
    inside it); a row's label is the config keys that differ from the first run's.

Every mode takes ``--sort COLUMN`` (``-COLUMN`` descending; default: by the swept keys). Bad input
(a missing run, a run without ``eval.json``, an unknown key, a key the mode cannot change) ends
with one line ``vitp-sweep: error: ...`` and exit status 2; a sweep where a training failed writes
the table of the others and exits with status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from vitp.cli import run_cli

log = logging.getLogger("vitp")

# what `vitp-sweep eval` may change: settings of the evaluation, not of the trained model or data
EVAL_KEYS = ("sampler.", "eval.", "objective.noise_scale", "objective.t_eps", "trainer.device")


@dataclass
class Sweep:
    """Command-line overrides split into fixed ones and swept axes, expanded to combinations."""

    fixed: List[str] = field(default_factory=list)  # "key=value" overrides with one value
    keys: List[str] = field(default_factory=list)  # swept keys, in command-line order
    combos: List[List[str]] = field(default_factory=lambda: [[]])  # "key=value" per combination
    labels: List[Dict[str, str]] = field(default_factory=lambda: [{}])  # {swept key: value} per combination


@contextlib.contextmanager
def _config_loader():
    """Hydra's config loader over the shipped ``conf/`` (what ``glob(...)`` lists group options with)."""
    import importlib.resources

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from vitp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(importlib.resources.files("vitp.conf")), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def expand(args: List[str]) -> List[List[str]]:
    """Every combination of ``args`` as ``vitp-train --multirun args`` runs them: Hydra's parser
    and its basic sweeper (``BasicSweeper.split_arguments``: the cartesian product, the last axis
    changing fastest), so ``key=a,b``, ``choice(...)``, ``range(...)``, ``sort(...)`` and, for
    group choices, ``glob(...)`` mean what they mean there. Raises ``ValueError`` (one line) on a
    malformed override, an ``interval(...)`` sweep, a key given twice or an empty sweep."""
    # Hydra's own default sweeper (hydra/sweeper: basic); split_arguments is a static method of it
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.errors import HydraException

    from vitp.cli.overrides import parse_overrides as parse

    with _config_loader() as loader:
        parsed = parse(args, loader)
        seen = set()
        for o in parsed:
            key = o.key_or_group
            if key in seen:
                raise ValueError(f"{key} is given twice; list its values once (key=a,b)")
            seen.add(key)
            if o.is_sweep_override() and not o.is_discrete_sweep():
                raise ValueError(f"{o.input_line!r}: interval(...) is a continuous range; list the values "
                                 "(key=a,b,c) or use range(start,stop,step)")
        try:
            (combos,) = BasicSweeper.split_arguments(parsed, None)
        except HydraException as e:
            raise ValueError(f"cannot expand {' '.join(args)}: {str(e).splitlines()[0]}") from None
    if not combos:
        raise ValueError(f"the sweep {' '.join(args)} has no combination: a glob(...) or range(...) matches nothing")
    return combos


def parse_overrides(args: List[str]) -> Sweep:
    """Split Hydra-style overrides into fixed ones and swept axes (``key=a,b``, ``key=range(0,3)``,
    ``key=[0.1,1],[0,1]``: two list values; ``key=[0.1,1]``: one) and expand the axes to their
    cartesian product, the last axis changing fastest (:func:`expand`). An axis is swept when
    its value differs between combinations. Raises ``ValueError`` as :func:`expand` does."""
    combos = expand(args)
    swept = [i for i in range(len(combos[0])) if len({c[i] for c in combos}) > 1]
    sw = Sweep(fixed=[o for i, o in enumerate(combos[0]) if i not in swept])
    sw.keys = [combos[0][i].split("=", 1)[0].lstrip("+~") for i in swept]
    sw.combos = [[c[i] for i in swept] for c in combos]
    sw.labels = [dict(zip(sw.keys, (o.split("=", 1)[1] for o in combo))) for combo in sw.combos]
    return sw


def check_eval_keys(sw: Sweep) -> None:
    """Refuse what `vitp-sweep eval` cannot change (``ValueError``, one line), as ``vitp-eval``
    refuses it (:func:`vitp.cli.overrides.refusal`): unknown keys with the schema's message, group
    choices, added or deleted keys, and keys outside :data:`EVAL_KEYS` (the model, data, training)."""
    from vitp.cli.overrides import parse_overrides as parse
    from vitp.cli.overrides import refusal

    for o in parse(sw.fixed + [o for combo in sw.combos for o in combo]):
        msg = refusal(o, "vitp-sweep eval", EVAL_KEYS, "; sweep recipes with vitp-sweep train")
        if msg:
            raise ValueError(msg)


def check_train_keys(sw: Sweep) -> None:
    """Refuse unknown keys (one line, the nearest key) and the keys the sweep sets itself."""
    from vitp.config import check_override_keys

    args = sw.fixed + [o for combo in sw.combos for o in combo]
    check_override_keys(args)
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in ("eval.enabled", "hydra.run.dir") or key.startswith("hydra.sweep"):
            raise ValueError(f"vitp-sweep train sets {key} itself (eval.enabled=true, one run dir per "
                             "combination under --out); leave it out")


def slug(label: Dict[str, str], index: int) -> str:
    """Folder name of a combination: ``003_cfg_scale_2_steps_20`` (index, then short keys and
    values; characters other than letters, digits, ``.``, ``_``, ``-`` become ``_``)."""
    text = "_".join(f"{k.rsplit('.', 1)[-1]}_{v}" for k, v in label.items())
    text = re.sub(r"__+", "_", re.sub(r"[^A-Za-z0-9._-]+", "_", text)).strip("_")[:60]
    return f"{index:03d}_{text}" if text else f"{index:03d}"


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def _report(paths: Dict[str, Path]) -> None:
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def eval_sweep(run_dir: Path, overrides: List[str], name: Optional[str] = None,
               weights: str = "model_ema.safetensors", sort: Optional[str] = None) -> Dict[str, Path]:
    """Evaluate every sampler setting of ``overrides`` on the run's weights (loaded once) and write
    the comparison to ``run_dir/sweeps/<name>/`` (default name: the date and time); ``wall_s`` is
    each evaluation's wall time in seconds. The run's ``eval.json`` is not touched."""
    from vitp.cli.eval import load_for_eval, weights_step
    from vitp.cli.overrides import apply_overrides
    from vitp.config import validate_config
    from vitp.eval import evaluate
    from vitp.eval.compare import make_row, sort_rows, write_comparison

    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist")
    sw = parse_overrides(overrides)
    check_eval_keys(sw)
    sort_rows([], sw.keys, sort)  # an unknown --sort column fails before any work
    cfg, gen, train_ds, heldout_ds, per_bucket, cond = load_for_eval(Path(run_dir), weights, sw.fixed)
    cfgs = [apply_overrides(cfg, combo, "vitp-sweep eval", EVAL_KEYS) for combo in sw.combos]
    for c in cfgs:
        validate_config(c)  # every setting checked before the first evaluation
    out = Path(run_dir) / "sweeps" / (name or _stamp())
    _write_plan(out, "eval", sw, run=str(run_dir), weights=weights)
    rows, step = [], weights_step(Path(run_dir), weights)
    for i, (c, label) in enumerate(zip(cfgs, sw.labels)):
        d, t0 = out / slug(label, i), time.perf_counter()
        res = evaluate(gen, c, train_ds, heldout_ds, Path(run_dir), full=True, step=step, buckets=per_bucket,
                       out=d / "eval.json", conditioning=cond)
        rows.append(make_row(label, res, d.name, time.perf_counter() - t0))
        log.info("setting %d/%d %s done", i + 1, len(cfgs), label)
    return write_comparison(rows, sw.keys, out, f"sampler sweep of {run_dir} ({weights}) " + " ".join(sw.fixed), sort)


def _write_plan(out: Path, mode: str, sw: Sweep, **extra) -> None:
    """``out/sweep.json``: the mode, fixed overrides, swept keys and each combination's folder.
    Raises ``ValueError`` when ``out`` holds another sweep's (its table would be replaced); the same
    sweep again (to finish it) is allowed."""
    from vitp.utils import atomic_write_text

    plan = {"mode": mode, **extra, "fixed": sw.fixed, "keys": sw.keys,
            "settings": [{"dir": slug(lab, i), "overrides": combo} for i, (lab, combo)
                         in enumerate(zip(sw.labels, sw.combos))]}
    path = out / "sweep.json"
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except ValueError:
            before = None
        if before != json.loads(json.dumps(plan)):
            raise ValueError(f"{out} holds another sweep ({path}: its table and comparison files would be replaced); "
                             "choose another --out (--name for vitp-sweep eval), or give that sweep's own command "
                             "to finish it")
    atomic_write_text(path, json.dumps(plan, indent=2) + "\n")


def run_world_size() -> int:
    """Processes each run of ``vitp-sweep train`` trains with: :func:`_train_one` starts one
    ``python -m vitp.cli.train`` with this process's environment, so the world that environment
    names (``WORLD_SIZE``, or an MPI / srun launcher's, as ``vitp-train`` adopts it), 1 without one."""
    from vitp.parallel.distributed import launcher_env

    return int({**os.environ, **launcher_env(os.environ)}.get("WORLD_SIZE", 1))


def _layout_refusal(cfg, args: List[str], label: Any, world: int) -> Optional[str]:
    """Why a combination (composed ``cfg`` of the overrides ``args``) cannot train its
    ``tp x cp x pp`` in the ``world`` processes its run gets (:func:`run_world_size`), or ``None``.
    With ``parallel.auto`` only the degrees ``args`` fix count (the planner chooses the others for
    that world: :func:`vitp.plan.fixed_keys`)."""
    from vitp.plan import fixed_keys

    par = cfg.parallel
    degrees = ("tp", "cp", "pp")
    if par.auto:
        degrees = tuple(k for k in degrees if f"parallel.{k}" in fixed_keys(args))
    need = math.prod(int(par[k]) for k in degrees)
    if world % need == 0:
        return None
    keys = " ".join(f"parallel.{k}={par[k]}" for k in degrees if par[k] > 1)
    if world == 1:
        procs, fit = "as one process", "one process trains (parallel.tp=1 parallel.cp=1 parallel.pp=1)"
    else:
        procs, fit = f"in this launch's WORLD_SIZE={world}", f"whose tp x cp x pp divides {world}"
    return (f"combination {label}: parallel.tp={par.tp} x parallel.cp={par.cp} x parallel.pp={par.pp} needs a "
            f"multiple of {need} processes, and vitp-sweep train starts each run {procs} (python -m "
            f"vitp.cli.train): sweep layouts {fit}, or train this one under a launcher (torchrun "
            f"--nproc_per_node {need} -m vitp.train ... {keys}; docs/launching.md) and compare the runs with "
            f"vitp-sweep collect; nothing was trained")


def _check_combinations(sw: Sweep) -> None:
    """Compose and validate every combination's config as ``vitp-train`` will, before any run:
    its layout against the processes each run is started with (:func:`run_world_size`) and the
    device ``trainer.device`` resolves to here. Raises ``ValueError`` naming the combination."""
    from vitp.cli.overrides import compose_checked
    from vitp.config import validate_config, validate_layout
    from vitp.parallel.distributed import resolve_device

    world = run_world_size()
    for combo, label in zip(sw.combos, sw.labels):
        args = sw.fixed + combo + ["eval.enabled=true"]
        try:
            cfg = compose_checked(args)
            validate_config(cfg)
            msg = _layout_refusal(cfg, args, label or args, world)
            if msg:
                raise ValueError(msg)  # the layout check's own fix starts a launcher the sweep does not use
            if not cfg.parallel.auto:  # the rest of vitp-train's layout rules (heads, batch split, ZeRO)
                validate_layout(cfg, world, resolve_device(cfg.trainer.device).type)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("combination ") else f"combination {label or args}: {e}") \
                from None


def _train_one(d: Path, args: List[str]) -> int:
    """Train one combination in ``d`` unless it already holds its finished run; the exit status."""
    if (d / "eval.json").is_file():
        done = d / ".hydra" / "overrides.yaml"
        if done.is_file():
            from omegaconf import OmegaConf

            if list(OmegaConf.load(done)) != [a for a in args if not a.lstrip("+~").startswith("hydra.")]:
                raise ValueError(f"{d} holds a run of other overrides ({done}); choose another --out")
        log.info("%s: finished before, kept", d)
        return 0
    from vitp.cli.overrides import hydra_override

    cmd = [sys.executable, "-m", "vitp.cli.train", *args, hydra_override("hydra.run.dir", str(d))]
    log.info("training %s", " ".join(cmd[3:]))
    return subprocess.run(cmd, env=dict(os.environ)).returncode


def train_sweep(overrides: List[str], out: Optional[Path] = None, sort: Optional[str] = None) -> Dict[str, Path]:
    """One ``vitp-train`` per combination of ``overrides`` (sequential, same seeds, each in
    ``out/NNN_<setting>/``; default ``out``: ``outputs/sweeps/<date_time>``), then the comparison
    of their ``eval.json`` in ``out``; ``wall_s`` is each run's ``train.log`` span. Raises
    ``ValueError`` before training anything when a key or a combination is invalid; exits with
    status 1 after writing the table when a training failed."""
    from vitp.eval.compare import log_wall_seconds, make_row, read_eval, sort_rows, write_comparison

    sw = parse_overrides(overrides)
    check_train_keys(sw)
    sort_rows([], sw.keys, sort)
    _check_combinations(sw)
    out = Path(out) if out is not None else Path("outputs") / "sweeps" / _stamp()
    _write_plan(out, "train", sw)
    rows, failed = [], []
    for i, (combo, label) in enumerate(zip(sw.combos, sw.labels)):
        d = out / slug(label, i)
        rc = _train_one(d, sw.fixed + combo + ["eval.enabled=true"])
        if rc != 0 or not (d / "eval.json").is_file():
            failed.append(f"{d.name} (exit status {rc})")
            continue
        rows.append(make_row(label, read_eval(d), d.name, log_wall_seconds(d)))
    paths = write_comparison(rows, sw.keys, out, f"recipe sweep {out} " + " ".join(sw.fixed), sort) if rows else {}
    if failed:
        if paths:
            _report(paths)
        print(f"vitp-sweep: {len(failed)} of {len(sw.combos)} runs failed: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)
    return paths


def run_dirs(dirs: List[Path]) -> List[Path]:
    """The run directories named by ``dirs``: a folder with ``.hydra/config.yaml`` is a run; any
    other folder stands for the runs directly inside it (sorted by name). Raises
    ``FileNotFoundError`` for a missing folder or one without runs."""
    runs = []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise FileNotFoundError(f"{d} does not exist")
        if (d / ".hydra" / "config.yaml").is_file():
            runs.append(d)
            continue
        inner = sorted(p for p in d.iterdir() if (p / ".hydra" / "config.yaml").is_file())
        if not inner:
            raise FileNotFoundError(f"{d} is neither a vitp run directory nor a folder of run directories")
        runs += inner
    return runs


def collect(dirs: List[Path], out: Optional[Path] = None, sort: Optional[str] = None) -> Dict[str, Path]:
    """The comparison of existing runs (:func:`run_dirs`), labelled by their config differences
    from the first run (:func:`vitp.eval.compare.config_diff`), written to ``out`` (default: the
    folder holding the runs); ``wall_s`` is each run's ``train.log`` span."""
    from vitp.eval.compare import config_diff, log_wall_seconds, make_row, read_eval, run_config, write_comparison

    runs = run_dirs(dirs)
    labels = config_diff([run_config(r) for r in runs])
    keys = list(labels[0])
    if out is None:
        out = Path(os.path.commonpath([str(r.resolve()) for r in runs])) if len(runs) > 1 else runs[0].parent
    apart = [k for k in keys if k.startswith(("eval.", "data.")) or k == "seed"]
    if apart:
        log.warning("runs differ in %s: their judges or held-out data differ, so sample accuracy and FD-digits "
                    "compare less well than held-out loss", ", ".join(apart))
    rows = []
    for r, label in zip(runs, labels):
        name = os.path.relpath(r.resolve(), Path(out).resolve())
        rows.append(make_row(label, read_eval(r), name, log_wall_seconds(r)))
    return write_comparison(rows, keys, Path(out), f"{len(runs)} runs", sort)


def _parser(mode: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"vitp-sweep {mode}", description=__doc__.split("\n\n")[0])
    if mode == "eval":
        p.add_argument("run_dir", type=Path)
        p.add_argument("--name", help="folder under RUN_DIR/sweeps/ (default: date and time)")
        p.add_argument("--weights", default="model_ema.safetensors", help="weights file inside RUN_DIR")
    elif mode == "train":
        p.add_argument("--out", type=Path, help="sweep folder (default: outputs/sweeps/<date_time>)")
    else:
        p.add_argument("dirs", nargs="+", type=Path, help="run directories, or folders of them")
        p.add_argument("--out", type=Path, help="where the comparison goes (default: the folder of the runs)")
    if mode != "collect":
        p.add_argument("overrides", nargs="*", default=[], help="key=value or key=a,b,c (cartesian product)")
    p.add_argument("--sort", help="sort rows by this column (-COLUMN: descending); default: the swept keys")
    return p


def run(argv: Optional[List[str]] = None) -> Dict[str, Path]:
    """Parse ``vitp-sweep MODE ...`` and run the mode; returns the written paths by suffix."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return {}
    modes = ("eval", "train", "collect")
    if not argv or argv[0] not in modes:
        got = f"got {argv[0]!r}" if argv else "got none"
        raise ValueError(f"the first argument is the mode, one of {', '.join(modes)} ({got}); see vitp-sweep MODE -h")
    mode = argv[0]
    a = _parser(mode).parse_intermixed_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if mode == "eval":
        paths = eval_sweep(a.run_dir, a.overrides, a.name, a.weights, a.sort)
    elif mode == "train":
        paths = train_sweep(a.overrides, a.out, a.sort)
    else:
        paths = collect(a.dirs, a.out, a.sort)
    _report(paths)
    return paths


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point ``vitp-sweep eval|train|collect ...``; bad input exits with a one-line
    message (status 2)."""
    run_cli("vitp-sweep", run, argv)


if __name__ == "__main__":
    main()
