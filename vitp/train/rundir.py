"""A run directory has one owner at a time and shows one run's history.

- :class:`RunDirLock`: an exclusive ``flock`` on ``<run_dir>/.vitp.lock`` held by rank 0 for
  the whole run. The kernel drops it when the owner exits or crashes, so it never goes stale; a
  second ``vitp-train`` into the same folder is refused, naming the owner.
- :func:`check_history`: a folder whose ``.hydra/config.yaml`` belongs to another config (and that
  has no checkpoint to resume) is refused, naming the differing keys; so is a folder that holds
  files but no vitp run. :func:`check_relaunch`: the same for a relaunch that would resume the
  folder's checkpoint with another config.
- :func:`drop_failed_attempt`: log lines, sample grids and TensorBoard events that an interrupted
  attempt wrote after the step we restart from are removed, so the outputs show one history; the
  results of a finished run resumed from an earlier checkpoint are moved aside first.
- :func:`hold_log_files`: records bound for log files inside the run directory (Hydra's
  ``train.log``) are held back until the launch has passed its checks
  (:func:`release_log_files`), so a refused launch writes no line into the folder, nor into the
  ``train.log`` of a run that owns it.
- :func:`resume_command`: what a stopped run prints to continue it in its folder.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import os
import shlex
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from vitp.checkpoint import truncate_log
from vitp.checkpoint.results import later_grids, set_aside_results
from vitp.checkpoint.storage import PROBE_PREFIX
from vitp.config import absolute_paths
from vitp.parallel import distributed as dist
from vitp.utils import load_run_yaml

log = logging.getLogger("vitp")

LOCK_FILE = ".vitp.lock"
# keys a relaunch may change without making it another run (how long, where to copy, how to load;
# paths.output_root itself places nothing of a run: the keys interpolating it are compared resolved)
RELAUNCH_KEYS = ("trainer.resume", "trainer.exit_at_step", "trainer.exit_after_minutes", "trainer.progress",
                 "trainer.max_steps", "trainer.export_dir", "trainer.output_data_dir", "trainer.tensorboard_dir",
                 "trainer.checkpoint_async", "trainer.checkpoint_compress", "trainer.export_shard_size_mb", "trainer.dist_timeout_minutes",
                 "trainer.keep_checkpoints", "data.num_workers", "paths.output_root")
# what a relaunch into a run with checkpoints may also change: its layout, as a resume at another
# layout or world size does (docs/checkpoints.md); parallel=auto plans these again for a new world size
LAYOUT_KEYS = ("parallel.tp", "parallel.cp", "parallel.cp_mode", "parallel.pp", "parallel.sequence_parallel",
               "parallel.activation_checkpoint_interval", "parallel.auto", "parallel.auto_device",
               "parallel.auto_memory_gib", "trainer.micro_batch_size", "trainer.device")
# comma-separated keys a launcher filled with paths of its own (vitp-sagemaker: the data channels'
# mount points), which a restarted job may get elsewhere: not compared with the run's record
LAUNCHER_KEYS_ENV = "VITP_LAUNCHER_KEYS"
_held: List[tuple] = []  # (buffer, file handler) pairs of hold_log_files


class RunDirBusy(ValueError):
    """Another live process owns the run directory."""


_LOCKS: "weakref.WeakSet[RunDirLock]" = weakref.WeakSet()  # held locks, dropped by forked children


def _drop_inherited_locks() -> None:
    """In a forked child (DataLoader workers): close the inherited lock descriptors. ``flock``
    belongs to the open file, which the children share: a worker outliving its killed trainer by
    the seconds torch's watchdog takes would otherwise keep the folder locked against the restart."""
    for lock in list(_LOCKS):
        if lock.fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
    _LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunDirLock:
    """Exclusive ownership of ``run_dir`` (``flock`` on ``.vitp.lock``, per open file, so two
    trainers in one process exclude each other too).

    Linux maps ``flock`` to POSIX locks on NFS, where clusters keep run folders; on a filesystem
    without locks we warn and go on unlocked. The lock file stays after a run (deleting it races
    with the next owner), bar a refused launch's own (:meth:`release`); it records the owner's
    host, pid and start time for the refusal message.
    """

    def __init__(self, run_dir: Path):
        self.path, self.fd = Path(run_dir) / LOCK_FILE, None
        self.was_empty = self.created = False  # set by acquire: what release(refused=True) removes
        self.previous: Optional[bytes] = None  # the last owner's record, put back by release(restore=True)

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunDirBusy` naming the owner and the fix."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.was_empty = not any(self.path.parent.iterdir())  # a new run dir: a refused launch leaves none
        self.created = not self.path.exists()  # a refused launch removes the lock file it created
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):
                log.warning("cannot lock %s (%s): make sure no other run writes to this folder", self.path, e)
                self.fd = fd
                return
            owner = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(f"run dir {self.path.parent} is in use by another vitp-train ({owner}); wait for it to "
                             f"finish or stop it, or choose another hydra.run.dir") from None
        self.previous = os.pread(fd, 4096, 0)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        _LOCKS.add(self)

    def release(self, restore: bool = False, refused: bool = False) -> None:
        """Give the folder up (idempotent); ``restore``: write the previous owner's record back
        first, so a launch that wrote nothing else (a finished run resumed) leaves the file as it was;
        ``refused``: a refused launch removes the lock file it created (a model folder given as
        ``hydra.run.dir`` keeps no ``.vitp.lock``) or puts the previous owner's record back, and
        removes the folder when it was empty, leaving no run dir behind (deleted while still held,
        so no other launch owns it)."""
        if self.fd is not None:
            if refused and self.created:
                with contextlib.suppress(OSError):
                    self.path.unlink()
                if self.was_empty:
                    with contextlib.suppress(OSError):
                        self.path.parent.rmdir()
            restore = restore or refused
            if restore and self.previous is not None:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, self.previous, 0)
            os.close(self.fd)  # closing drops the lock
            self.fd = None

    def __del__(self):
        self.release()


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Rank 0 takes the lock of ``run_dir``; every rank raises :class:`RunDirBusy` if it could not
    (collective when the process group is initialised)."""
    lock, error = RunDirLock(run_dir), None
    if dist.is_main():
        try:
            lock.acquire()
        except RunDirBusy as e:
            error = str(e)
    error = dist.broadcast_object(error)
    if error:
        raise RunDirBusy(error)
    return lock


def _flat(cfg: Any) -> dict:
    container = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    out = {}
    for k, v in container.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat(v).items()})
        else:
            out[k] = v
    return out


def _differing(saved: Any, cfg: Any, ignore) -> List[tuple]:
    """``[(key, saved value, cfg value), ...]`` for the keys (outside ``ignore`` and the launcher's,
    :data:`LAUNCHER_KEYS_ENV`) that differ, sorted; keys of only one side (a record of an earlier
    vitp, whose schema lacked or had them) are not compared."""
    a, b = _flat(saved), _flat(cfg)
    launcher = [k for k in os.environ.get(LAUNCHER_KEYS_ENV, "").split(",") if k]
    keys = sorted((set(a) & set(b)) - set(ignore) - set(launcher))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def config_differences(saved: Any, cfg: DictConfig, ignore=RELAUNCH_KEYS) -> List[str]:
    """``["model.depth: 2 before vs 3 now", ...]`` for keys (outside ``ignore``) that differ."""
    return [_said(*d) for d in _differing(saved, cfg, ignore)]


def _said(key: str, before: Any, now: Any) -> str:
    return f"{key}: {before!r} before vs {now!r} now"


def _override(key: str, value: Any) -> str:
    """``key=value`` as a command line gives it (``null``, ``true``, JSON lists), shell-quoted."""
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else \
        json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return shlex.quote(f"{key}={text}")


def _recorded(run_dir: Path) -> Optional[dict]:
    """The run's recorded config (``.hydra/config.yaml``, resolved), or ``None`` without one; paths
    that a run recorded before they were stored absolute are read from the working directory, as
    that run read them (:func:`vitp.config.absolute_paths`)."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    return OmegaConf.to_container(absolute_paths(load_run_yaml(path)), resolve=True) if path.is_file() else None


def _absolute(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with its paths absolute, as the trainer records them."""
    return absolute_paths(copy.deepcopy(cfg))


def check_relaunch(run_dir: Path, cfg: DictConfig, tag: Path) -> None:
    """Refuse (``ValueError``) a relaunch into a run directory with checkpoints (not ``vitp-train
    --resume``, whose overrides change the run on purpose) whose recorded config differs from
    ``cfg`` outside :data:`RELAUNCH_KEYS` and :data:`LAYOUT_KEYS`: it would continue that run with
    another config, and record it as the run's. The message names the keys and both fixes. A run
    dir without a record (written before vitp kept one) is not checked."""
    saved = _recorded(run_dir)
    diffs = _differing(saved, _absolute(cfg), RELAUNCH_KEYS + LAYOUT_KEYS) if saved is not None else []
    if not diffs:
        return
    more = len(diffs) > 8
    shown = "; ".join(_said(*d) for d in diffs[:8]) + ("; ..." if more else "")
    given = " ".join(_override(k, y) for k, _, y in diffs[:8]) + (" ..." if more else "")
    raise ValueError(f"{run_dir} holds another config's run, with checkpoints up to {tag.name} ({shown}): these "
                     f"settings were not applied and nothing was written; to continue that run with them on purpose: "
                     f"vitp-train --resume {shlex.quote(str(run_dir))} {given}; to start a new run with them, choose "
                     f"another hydra.run.dir")


def unapplied(run_dir: Path, cfg: DictConfig) -> List[str]:
    """``["optim.lr=0.5", ...]``: the settings of ``cfg`` that differ from the run's recorded config
    outside :data:`RELAUNCH_KEYS` and :data:`LAYOUT_KEYS` (how a launch runs, not what it trains),
    for a launch that trains nothing (a finished run resumed) to say they were not applied."""
    saved = _recorded(run_dir)
    if saved is None:
        return []
    return [_override(k, y) for k, _, y in _differing(saved, _absolute(cfg), RELAUNCH_KEYS + LAYOUT_KEYS)]


def check_same_config(cfg: DictConfig) -> None:
    """Refuse (``ValueError`` on every rank) a job whose ranks were launched with different configs:
    on several nodes each launcher agent passes its own command line, and a node given other
    overrides (a seed, a batch size) would train another model on its replicas, or hang in a
    collective of another shape. Collective; the message names the ranks and the keys that differ."""
    if dist.world_size() == 1:
        return
    mine = _flat(cfg)
    ref = dist.broadcast_object(mine)
    diff = [f"{k}={mine.get(k)!r} (rank 0: {ref.get(k)!r})" for k in sorted(set(ref) | set(mine))
            if ref.get(k) != mine.get(k)]
    report = [(r, d) for r, d in enumerate(dist.gather_objects(diff)) if d]
    if report:
        shown = "; ".join(f"rank {r}: {', '.join(d[:3])}" for r, d in report[:3])
        raise ValueError(f"the ranks of this job were launched with different configs ({shown}): launch every node "
                         f"with the same command line and overrides")


FRESH_OWN = (".vitp.lock", "train.log")  # what a launch may have left before its run wrote .hydra/


def check_history(run_dir: Path, cfg: DictConfig, resumed: bool = False) -> None:
    """Refuse (``ValueError``) a fresh start in a folder that holds another config's run (its
    ``.hydra/config.yaml`` differs from ``cfg`` in more than :data:`RELAUNCH_KEYS`; the message
    names the keys), or that holds files and no vitp run at all (a data folder, someone's notes):
    training would write ``metrics.jsonl``, ``samples/`` ... among them and replace files of the
    same names. ``resumed`` (``vitp-train --resume RUN key=value`` of a run without a checkpoint,
    e.g. one that diverged before its first): the changed settings are what the user asked for, so
    the run starts over with them, saying so."""
    saved = _recorded(run_dir)
    if saved is None:
        present = sorted(p.name for p in Path(run_dir).iterdir()
                         if p.name not in FRESH_OWN and not p.name.startswith(PROBE_PREFIX)) \
            if Path(run_dir).is_dir() else []
        if present:
            raise ValueError(f"{run_dir} is not empty and holds no vitp run ({', '.join(present[:4])}"
                             f"{', ...' if len(present) > 4 else ''}): a run would write its outputs among these "
                             f"files; choose a new or empty hydra.run.dir")
        return
    diffs = config_differences(saved, _absolute(cfg))
    if diffs and resumed:
        log.warning("%s has no checkpoint to continue: --resume starts it over from step 0 with the settings given "
                    "(%s)", run_dir, "; ".join(diffs[:8]))
    elif diffs:
        raise ValueError(f"{run_dir} holds another config's run ({'; '.join(diffs[:8])}"
                         f"{'; ...' if len(diffs) > 8 else ''}); choose a new hydra.run.dir, or relaunch with that "
                         f"run's config to continue it")


def drop_failed_attempt(run_dir: Path, start_step: int) -> None:
    """Remove what an interrupted attempt wrote after ``start_step`` (everything when starting from
    scratch): ``metrics.jsonl`` / ``eval.jsonl`` lines and ``samples/step_*`` grids. TensorBoard
    events are hidden by the run logger's ``purge_step``. Results of a later step (a finished run
    resumed from an earlier checkpoint: its weights, ``eval.json``, final sample grid) are first
    moved aside with copies of both logs (:func:`vitp.checkpoint.results.set_aside_results`), so
    the rows dropped here are kept there and the logs never hold a step twice."""
    aside = set_aside_results(run_dir, start_step)
    keep_upto = start_step if start_step else -1  # a fresh start redoes the step-0 evaluation too
    for name in ("metrics.jsonl", "eval.jsonl"):
        dropped = truncate_log(run_dir / name, keep_upto)
        if dropped:
            log.warning("%s: dropped %d lines %slogged after step %d%s", name, dropped,
                        "" if aside else "of an interrupted attempt ", max(keep_upto, 0),
                        f" (the whole file is kept in {aside})" if aside else "")
    for p in later_grids(run_dir, start_step):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def nearest_existing(path: Path) -> Path:
    """``path`` (made absolute) or its nearest ancestor that exists: what a launch finds of its run
    dir before Hydra makes it (:func:`remove_made_dirs`)."""
    p = Path(os.path.abspath(path))
    return next(q for q in (p, *p.parents) if q.exists())


def remove_made_dirs(run_dir: Path, existed: Path) -> None:
    """Remove ``run_dir``, then its parents, while each is an empty folder below the deepest folder
    it shares with ``existed`` (:func:`nearest_existing` of the planned run dir before Hydra made
    it): the folders a launch refused before writing anything made (``outputs/<date>/<time>`` of a
    missing data folder). A folder that holds anything stays (a resumed run's), and so does every
    folder above it, ``existed`` and its ancestors."""
    p, e = Path(os.path.abspath(run_dir)), Path(os.path.abspath(existed))
    stop = Path(os.path.commonpath([p, e]))
    while stop in p.parents:
        try:
            p.rmdir()  # fails unless empty
        except OSError:
            return
        p = p.parent


def resume_command(run_dir: Path, env: Optional[Mapping[str, str]] = None) -> str:
    """The command that continues the run in ``run_dir`` (absolute, shell-quoted), for the line a
    stopped run ends with: ``vitp-train --resume RUN_DIR`` for one process, ``torchrun
    --nproc_per_node N -m vitp.train --resume RUN_DIR`` for one node of torchrun (``env``: the
    launcher's variables, default ``os.environ``); under another launcher a sentence asking for
    that launcher's command with ``-m vitp.train --resume RUN_DIR``."""
    env = os.environ if env is None else env
    folder = shlex.quote(str(Path(run_dir).resolve()))
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1:
        return f"vitp-train --resume {folder}"
    if "TORCHELASTIC_RUN_ID" in env and env.get("LOCAL_WORLD_SIZE") == str(world):
        return f"torchrun --nproc_per_node {world} -m vitp.train --resume {folder}"
    return f"this run's launcher ({world} processes) with -m vitp.train --resume {folder}"


class _Buffer(logging.Handler):
    """Keeps the records it is given, for the file handler it stands in for."""

    def __init__(self, level: int):
        super().__init__(level)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def hold_log_files(run_dir: Path) -> None:
    """Replace every root-logger ``logging.FileHandler`` writing inside ``run_dir`` (Hydra's
    ``train.log``) by a buffer until :func:`release_log_files`. Idempotent; does nothing without
    such handlers. Hydra opens its file handler at start-up unless ``delay=true``, which
    :func:`vitp.cli.train.prepare_argv` sets, so a held ``train.log`` is not even created."""
    root, folder = logging.getLogger(), Path(run_dir).resolve()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and folder in Path(h.baseFilename).resolve().parents:
            buffer = _Buffer(h.level)
            root.removeHandler(h)
            root.addHandler(buffer)
            _held.append((buffer, h))


def release_log_files(write: bool) -> None:
    """End :func:`hold_log_files`: with ``write``, the held records go to their files (their own
    time stamps) and the file handlers take over again; without, the records are dropped and the
    handlers closed, so the files get nothing (a refused launch)."""
    root = logging.getLogger()
    while _held:
        buffer, handler = _held.pop(0)
        root.removeHandler(buffer)
        if write:
            for record in buffer.records:
                handler.handle(record)
            root.addHandler(handler)
        else:
            handler.close()
