"""``vitp-train``: Hydra config -> :func:`vitp.train.train`, under any launcher.

``vitp-train [overrides]`` (one process), ``vitp-train --resume RUN_DIR [overrides]`` (continue a
stopped run in its folder with its recorded config, :func:`resume_config`), ``torchrun --nproc_per_node N -m vitp.train [overrides]``,
``deepspeed --num_gpus N --module vitp.train [overrides]`` (its ``--local_rank`` is stripped),
``mpirun -np N python -m vitp.train [overrides]`` / ``srun`` (ranks from the launcher's variables,
:func:`vitp.parallel.distributed.launcher_env`), or SageMaker (:mod:`vitp.cli.sagemaker`). Every
rank uses the run directory rank 0 resolved, whatever its interpolations; a launcher that names
the job (Slurm, ``torchrun --rdzv-id``, SageMaker) gets ``<output_root>/<job id>`` by default, so
a requeued job resumes.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

import torch

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations checks PyPI at import otherwise
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would warn and probe for accelerators

from omegaconf import DictConfig  # noqa: E402

from vitp.checkpoint import latest_meta  # noqa: E402
from vitp.cli import run_cli  # noqa: E402
from vitp.cli.overrides import (  # noqa: E402
    apply_overrides, check_run_dir, compose_checked, hydra_override, is_override, override_key, parse_overrides,
    typed_config)
from vitp.config import check_override_keys, register_configs  # noqa: E402
from vitp.parallel import distributed as dist  # noqa: E402
from vitp.train import check_config, train  # noqa: E402
from vitp.train.logger import quiet_other_ranks, quiet_third_party  # noqa: E402
from vitp.train.rundir import hold_log_files, nearest_existing, release_log_files, remove_made_dirs  # noqa: E402
from vitp.utils import load_run_yaml  # noqa: E402

log = logging.getLogger("vitp")


_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def launcher_job_id(env: Mapping[str, str]) -> Optional[str]:
    """A name for the job that survives a requeue, from the launcher's environment, or ``None``.

    ``SLURM_JOB_ID`` (kept by ``scontrol requeue``; arrays: ``<array job>_<task>``) -> ``slurm-<id>``;
    ``TORCHELASTIC_RUN_ID`` from ``torchrun --rdzv-id`` -> ``torchrun-<id>`` (not ``none``, nor the
    random id of ``--standalone``); ``TRAINING_JOB_NAME`` (SageMaker) -> ``sagemaker-<name>``.
    """
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    elif env.get("SLURM_JOB_ID"):
        job = f"slurm-{env['SLURM_JOB_ID']}"
    elif env.get("TORCHELASTIC_RUN_ID", "none") != "none" and not _UUID.match(env["TORCHELASTIC_RUN_ID"]):
        job = f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    elif env.get("TRAINING_JOB_NAME"):
        job = f"sagemaker-{env['TRAINING_JOB_NAME']}"
    else:
        return None
    return re.sub(r"[^A-Za-z0-9._-]", "_", job)


def default_run_dir() -> Optional[str]:
    """The ``hydra.run.dir`` to use when the user named none: ``${paths.output_root}/<job id>`` when the
    launcher names the job (so a requeued job resumes), else ``None`` (Hydra's default,
    ``<output_root>/<date>/<time>``; under a multi-process launcher every rank then uses rank 0's,
    :func:`_shared_run_dir`)."""
    job = launcher_job_id(os.environ)
    return "${paths.output_root}/" + job if job else None


def _shared_run_dir(mine: str) -> str:
    """Rank 0's resolved run directory on every rank (``hydra.run.dir`` may hold ``${now:...}``);
    a folder Hydra made for this rank alone is removed when empty."""
    chosen = dist.broadcast_object(mine)
    if chosen != mine:
        with contextlib.suppress(OSError):
            os.rmdir(mine)
    return chosen


_resume_dir: Optional[Path] = None  # the RUN_DIR of vitp-train --resume RUN_DIR (set by prepare_argv)
_stopped_by: Optional[str] = None  # the signal that stopped the run (set by _train), for main's exit status
_own_run_dir = False  # a plain hydra.run.dir or --resume: each rank keeps its launcher's path (prepare_argv)
_existed: Optional[Path] = None  # the run dir's nearest folder before Hydra made it (prepare_argv; None: a sweep)


def split_resume(args: List[str]) -> Tuple[Optional[str], List[str]]:
    """``(RUN_DIR, the other arguments)`` of ``--resume RUN_DIR`` / ``--resume=RUN_DIR`` in ``args``
    (``RUN_DIR`` ``None`` without the flag). Raises ``ValueError`` for a ``--resume`` without a
    folder or given twice."""
    found, rest, i = [], [], 0
    while i < len(args):
        if args[i] == "--resume":
            if i + 1 == len(args) or args[i + 1].startswith("-") or is_override(args[i + 1]):
                raise ValueError("--resume needs the run directory to continue: vitp-train --resume RUN_DIR")
            found.append(args[i + 1])
            i += 2
            continue
        if args[i].startswith("--resume="):
            found.append(args[i].split("=", 1)[1])
        else:
            rest.append(args[i])
        i += 1
    if len(found) > 1:
        raise ValueError(f"--resume given {len(found)} times ({', '.join(found)}); continue one run at a time")
    return (found[0] if found else None), rest


def resume_config(run_dir: Path, overrides: List[str]) -> DictConfig:
    """The config that continues the run in ``run_dir`` (``vitp-train --resume RUN_DIR``): the
    run's recorded ``.hydra/config.yaml`` on the typed schema, ``trainer.resume=auto`` (the run
    dir's latest checkpoint; a run forked from another checkpoint that has none of its own yet
    keeps its recorded path), no ``trainer.exit_at_step`` when the run already stopped there (one
    still ahead stays), and the ``key=value`` ``overrides`` set on it, e.g.
    ``trainer.max_steps=2000`` to train longer, or ``trainer.resume=RUN_DIR/checkpoints/step_N`` to
    continue from an earlier checkpoint of the run (its latest is broken; its results of a later
    step are then moved aside, :func:`vitp.checkpoint.results.set_aside_results`).

    Raises ``FileNotFoundError`` when ``run_dir`` holds no recorded config; ``ValueError`` (one
    line) for a group choice (``experiment=...``: the run's config is already composed), a
    ``hydra.*`` key, ``trainer.resume`` outside the run's checkpoints, an unknown key or a bad value."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not Path(run_dir).exists():
        raise FileNotFoundError(f"--resume {run_dir}: no such folder; give the run dir a stopped run printed (its "
                                f"'run dir' log line)")
    if not path.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no {path}, so not a folder vitp-train wrote; give the run dir a "
                                f"stopped run printed (its 'run dir' log line)")
    own = (Path(run_dir) / "checkpoints").resolve()
    for o in overrides:
        if override_key(o) == "trainer.resume" and own in Path(o.split("=", 1)[-1]).resolve().parents:
            continue  # an earlier checkpoint of this run (the latest is broken): continue from it, here
        if override_key(o) in ("trainer.resume", "hydra.run.dir"):
            raise ValueError(f"{o}: --resume {run_dir} continues that folder from its latest checkpoint (or "
                             f"trainer.resume=<one of its own checkpoints>); drop {override_key(o)}, or leave out "
                             f"--resume to start a new run dir from a checkpoint")
    cfg = typed_config(load_run_yaml(path), path)
    if (Path(run_dir) / "checkpoints" / "latest").is_file() or cfg.trainer.resume == "never":
        cfg.trainer.resume = "auto"
    stop, latest = cfg.trainer.exit_at_step, latest_meta(Path(run_dir) / "checkpoints")
    if stop is not None and latest is not None and stop <= latest["step"]:
        cfg.trainer.exit_at_step = None  # the stop the run already made: --resume continues past it
    return apply_overrides(cfg, overrides, "vitp-train --resume")


def _recorded_overrides(run_dir: Path) -> List[str]:
    """The overrides the run in ``run_dir`` was composed with (``.hydra/overrides.yaml``), if recorded."""
    path = run_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in load_run_yaml(path)] if path.is_file() else []


def literal_run_dir(args: List[str]) -> bool:
    """Whether the command line (before Hydra resolves it: Hydra records the resolved path)
    named its run directory as a plain path (``hydra.run.dir=/scratch/run``), without
    interpolations such as ``${now:...}``: every rank then uses its own launcher's path
    (node-local run dirs when nodes name different folders)."""
    given = [o.split("=", 1)[1] for o in args if o.split("=", 1)[0].lstrip("+") == "hydra.run.dir"]
    return bool(given) and "${" not in given[-1]


def _train(cfg: DictConfig, run_dir: str, overrides: list, own_run_dir: bool = False) -> dict:
    """:func:`vitp.train.train` under any launcher: with several processes, the config and layout
    are checked (:func:`vitp.train.check_config`) before the process group starts, and every rank
    then uses rank 0's run directory, unless ``own_run_dir`` (a plain ``hydra.run.dir``,
    :func:`literal_run_dir`: each node's launcher names its folder). With ``--resume RUN_DIR`` the
    config is the run's recorded one with ``overrides`` set (:func:`resume_config`)."""
    quiet_third_party()  # before the process group starts (DeepSpeed probes its ops then)
    if _resume_dir is not None:
        cfg, overrides = resume_config(_resume_dir, overrides), _recorded_overrides(_resume_dir) + list(overrides)
    if dist.world_size() > 1:
        check_config(cfg, run_dir=Path(run_dir))  # on every rank alike, before any process group exists
        dist.init_distributed(dist.resolve_device(cfg.trainer.device), dist.timeout_of(cfg))
        if not own_run_dir:
            run_dir = _shared_run_dir(run_dir)
    global _stopped_by
    result = train(cfg, run_dir, overrides, resumed=_resume_dir is not None)
    _stopped_by = result.get("signal")
    return result


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()

    @hydra.main(version_base="1.3", config_path=_config_path(), config_name="config")
    def _main(cfg: DictConfig) -> None:
        hc = HydraConfig.get()  # returns normally after a signal's save: main() sets the exit status
        quiet_other_ranks()  # a line every rank logs is printed once, by rank 0
        hold_log_files(hc.runtime.output_dir)  # train.log gets lines only once the launch's checks pass
        try:
            run_cli("vitp-train", _train, cfg, hc.runtime.output_dir, list(hc.overrides.task),
                    _own_run_dir, log=log)
        except BaseException as e:
            if _existed is not None and not (isinstance(e, SystemExit) and e.code in (0, None)):
                remove_made_dirs(Path(hc.runtime.output_dir), _existed)  # refused before writing: no empty folder
            raise
        finally:
            release_log_files(write=False)  # a refused launch: its lines (and error) went to the console only

    _main()


def _config_path() -> str:
    """Absolute path of the shipped ``conf/`` folder (installed as the ``vitp.conf`` package)."""
    import importlib.resources

    return str(importlib.resources.files("vitp.conf"))


def prepare_argv(argv: list) -> list:
    """Launcher-independent argv for Hydra; starts no process group (``vitp-train`` starts it
    after the config and layout checks, :func:`_train`).

    Strips ``--local_rank``; with ``--resume RUN_DIR`` checks the overrides against that run's
    recorded config (:func:`resume_config`) and sets ``hydra.run.dir=RUN_DIR``; refuses unknown
    keys and takes the ranks of an MPI or srun launch from its variables; keeps non-zero ranks from writing log files and makes rank 0's
    ``train.log`` open on its first line (``delay=true``: a refused launch creates none,
    :func:`vitp.train.rundir.hold_log_files`); without ``hydra.run.dir`` it picks
    :func:`default_run_dir`; it notes the run dir's nearest existing folder, so that a launch
    refused before writing removes the empty folders Hydra made for it
    (:func:`vitp.train.rundir.remove_made_dirs`). Raises ``ValueError`` on an unknown key, a value the schema refuses,
    a layout that does not fit the launch's world size (:func:`vitp.train.check_config`), a run
    directory that cannot be made (:func:`vitp.cli.overrides.check_run_dir`), a bad ``--resume``,
    or an MPI launch across hosts without ``MASTER_ADDR``; ``FileNotFoundError`` for a ``--resume``
    folder without a recorded config, or a dotted key without ``=value``.
    """
    global _resume_dir, _own_run_dir, _existed
    argv = dist.strip_launcher_args(argv)
    resume, args = split_resume(argv[1:])
    argv, _resume_dir, cfg = argv[:1] + args, None, None
    for prev, word in zip(argv[:-1], args):  # `trainer.max_steps 10`: Hydra's parser says "missing EQUAL"
        if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", word) and not prev.startswith("-"):
            raise ValueError(f"{word!r} has no value: write {word}=VALUE (Hydra's key=value)")
    if not any(a in ("-m", "--multirun") for a in args):  # Hydra's own parse error would not name the argument
        parse_overrides([a for a in args if is_override(a)])
    if resume is not None:  # the run's recorded config with the overrides: checked here, used by _train
        if any(a in ("-m", "--multirun") for a in args):
            raise ValueError(f"--resume {resume} continues one run; it does not sweep (drop -m)")
        cfg = resume_config(Path(resume), [a for a in args if is_override(a)])
        _resume_dir = Path(resume).resolve()
    elif any(a in ("-m", "--multirun") for a in args):
        check_override_keys(args)  # sweeps: Hydra composes each job
    else:  # an unknown key or a bad value: one line, before anything starts
        cfg = compose_checked([a for a in args if is_override(a)])
    dist.adopt_launcher_env()  # before world_size(): an mpirun rank would otherwise train alone
    if cfg is not None:  # the layout for this launch's world size, also before Hydra starts
        given = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == "hydra.run.dir"]
        run_dir = _resume_dir or (Path(given[-1]) if given and "${" not in given[-1] else None)
        check_config(cfg, run_dir=run_dir)  # a resumed run's checkpoint layout is named in a refusal
    ours = []  # put before the user's arguments, so Hydra flags like --cfg job / --info stay last
    if not any(a.startswith("hydra.output_subdir=") for a in argv):
        ours.append("hydra.output_subdir=null")  # train() writes .hydra/ itself, after its checks pass
    _own_run_dir = _resume_dir is not None or literal_run_dir(args)
    if _resume_dir is not None:
        ours.append(hydra_override("hydra.run.dir", str(_resume_dir)))
    elif not any(a.startswith("hydra.run.dir=") for a in argv):
        run_dir = default_run_dir()
        if run_dir:
            ours.append(f"hydra.run.dir={run_dir}")
    if not dist.is_main():
        ours.append("hydra/job_logging=stdout")
    elif not any(a.startswith(("hydra/job_logging=", "hydra.job_logging")) for a in argv):
        ours.append("++hydra.job_logging.handlers.file.delay=true")  # Hydra's default file handler
    _existed = None
    if not any(a in ("-m", "--multirun") for a in argv[1:]):
        planned = check_run_dir([a for a in ours + argv[1:] if is_override(a)], resume=_resume_dir is not None)
        _existed = nearest_existing(Path(planned))  # before Hydra makes it: a refusal removes what it made
    return argv[:1] + ours + argv[1:]


def main(signal_exit: bool = True) -> None:
    """Console entry point ``vitp-train``. A run a signal stopped exits, after its checkpoint, with
    ``128 + signal`` (130 SIGINT, 143 SIGTERM: :func:`vitp.train.stop.exit_status`), unless not
    ``signal_exit`` (``vitp-sagemaker``: SageMaker stops a job, spot interruptions included, with
    SIGTERM and restarts it from its checkpoints, so the saved stop is no failure there: exit 0)."""
    # At exit the interpreter's garbage collections walk every object torch, DeepSpeed and the run
    # left: 2.2-2.9 s per process on a 2-core CPU, 0.4 s frozen (measured); under a launcher it
    # waits for the slowest rank. Nothing is written by then (logs and files are closed explicitly).
    atexit.register(gc.freeze)
    sys.argv = run_cli("vitp-train", prepare_argv, sys.argv)
    _hydra_entry()
    if signal_exit and _stopped_by:
        from vitp.train.stop import exit_status

        raise SystemExit(exit_status(_stopped_by))


if __name__ == "__main__":
    main()
