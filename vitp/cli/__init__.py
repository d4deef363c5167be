"""Command-line entry points (thin: parse, call the package, report bad input).

``vitp-train`` (:mod:`.train`), ``vitp-sample`` (:mod:`.sample`), ``vitp-eval`` (:mod:`.eval`),
``vitp-export`` (:mod:`.export`), ``vitp-sagemaker`` (:mod:`.sagemaker`), ``vitp-plan`` (:mod:`.plan`),
``vitp-sweep`` (:mod:`.sweep`). Every one takes config changes in one syntax, Hydra's
``key=value`` overrides checked by the schema (:mod:`.overrides`); flags are for paths and counts.
Bad input (missing or corrupt files, impossible layouts, wrong config values) ends every one of
them the same way: one line ``<prog>: error: <message>`` on stderr and exit status 2
(:data:`EXIT_BAD_INPUT`), no traceback. A training whose loss turned NaN or infinite ends the
same way with exit status 3 (:data:`EXIT_NON_FINITE`), the message saying where the non-finite
value first appeared (:mod:`vitp.train.nonfinite`), and so does a write the storage refused
(no permission, a read-only file system, a full disk: :data:`STORAGE_ERRNOS`), with status 2.
Any other error is a bug: a traceback and exit status 1.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


RANK_ZERO_GRACE_S = 2.0  # seconds the other ranks wait before exiting with a refusal rank 0 prints
EXIT_BAD_INPUT = 2  # bad input: missing or corrupt files, impossible layouts, wrong config values
EXIT_NON_FINITE = 3  # the training loss turned NaN or infinite (FloatingPointError)


def bad_input_errors() -> tuple:
    """Exception types that mean bad input, not a bug: reported in one line, exit status 2."""
    from omegaconf.errors import OmegaConfBaseException

    return ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, OmegaConfBaseException


def reported_errors() -> tuple:
    """Exception types reported in one line without a traceback: bad input, storage that failed
    (a shard that cannot be fetched or read: :class:`vitp.data.base.StorageError`) and a non-finite loss."""
    from vitp.data.base import StorageError

    return (*bad_input_errors(), StorageError, FloatingPointError)


def exit_status(error: BaseException) -> int:
    """The exit status for a :func:`reported_errors` instance: 3 for a non-finite loss, else 2."""
    return EXIT_NON_FINITE if isinstance(error, FloatingPointError) else EXIT_BAD_INPUT


def record_for_torchrun(line: str) -> bool:
    """Under ``torchrun`` (torch.distributed.elastic), write ``line`` to this worker's error file
    (``TORCHELASTIC_ERROR_FILE``, in the JSON layout of torch's ``ErrorHandler.record_exception``
    without a Python call stack), so torchrun's failure summary shows it as the rank's
    ``traceback`` instead of "To enable traceback see ...". torchrun prints that summary (its own
    ``ChildFailedError`` traceback) after the workers exit, so nothing a worker does can come after
    it; with this, the summary's last entry, the root cause, is the line. True if written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:
        return False
    return True


def log_files_only(log: logging.Logger, line: str) -> int:
    """Write ``line`` as an ERROR record of ``log`` to the log files among its handlers and the
    root logger's (a run's ``train.log``), not to the console; returns how many files got it."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    files = [h for h in (*log.handlers, *logging.getLogger().handlers)
             if isinstance(h, logging.FileHandler) and record.levelno >= h.level]
    for h in files:
        h.handle(record)
    return len(files)


# errno of an OSError that is the storage's answer, not a bug: reported in one line with its fix
STORAGE_ERRNOS = {errno.EACCES: "write elsewhere, or fix that folder's permissions",
                  errno.EPERM: "write elsewhere, or fix that folder's permissions",
                  errno.EROFS: "a read-only file system: write elsewhere",
                  errno.ENOSPC: "the disk is full: free space there or write elsewhere"}


# CLIs a Ctrl-C stops with one line instead of a traceback, and what the user has then
STOPPABLE = {"vitp-eval": "FID / FVD sample blocks written so far (if the evaluation runs them) are kept: the "
                          "same command resumes from them",
             "vitp-sample": "nothing was written"}


def run_cli(prog: str, fn: Callable[..., T], *args: Any, log: Optional[logging.Logger] = None) -> T:
    """``fn(*args)``; on bad input or a non-finite loss write ``<prog>: error: <message>`` to
    stderr, one line (and, with ``log``, to its log files: the run's ``train.log`` where one is
    open, :func:`log_files_only`), and exit with :func:`exit_status` (2, or 3 for a non-finite
    loss); a Ctrl-C in a :data:`STOPPABLE` CLI prints one line and exits with 130. Under ``torchrun`` the line also goes to
    the worker's error file (:func:`record_for_torchrun`), and only each node's first rank
    (``LOCAL_RANK`` 0) writes it to stderr: torchrun's summary lists every failed rank's line. A :class:`vitp.utils.RankZeroError` (rank 0's
    refusal, raised on the other ranks) goes to the error file only: rank 0 prints it once. An
    ``OSError`` of :data:`STORAGE_ERRNOS` (no permission, a read-only file system, a full disk)
    is reported the same way, with its fix; other ``OSError`` s keep their traceback."""
    try:
        return fn(*args)
    except BrokenPipeError:  # `vitp-plan ... | head`: the reader has what it wanted; no traceback
        with contextlib.suppress(OSError, ValueError):  # Python's own recipe (signal docs); no fileno in tests
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if prog not in STOPPABLE:  # vitp-train handles its own signals (a checkpoint first)
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: stopped (Ctrl-C); {STOPPABLE[prog]}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except reported_errors() as e:
        _report(prog, e, log)
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:  # any other OSError may be a bug: keep its traceback
            raise
        _report(prog, e, log)


def _report(prog: str, e: BaseException, log: Optional[logging.Logger]) -> None:
    """:func:`run_cli`'s one line for ``e`` (stderr, the run's log, torchrun's error file), then exit."""
    from vitp.utils import RankZeroError

    line = f"{prog}: error: {e}"
    if isinstance(e, OSError) and e.filename and e.errno in STORAGE_ERRNOS:  # raised by the OS: e names the path
        line += f" ({STORAGE_ERRNOS[e.errno]})"
    recorded = record_for_torchrun(line)
    other_rank = recorded and os.environ.get("RANK", "0") != "0"
    if log is not None and not isinstance(e, RankZeroError):
        log_files_only(log, line)
    node_first = os.environ.get("LOCAL_RANK", "0") == "0"  # each node's console shows the line once
    if not isinstance(e, RankZeroError) and (not other_rank or node_first):  # rank 0 prints a RankZeroError
        print(line, file=sys.stderr, flush=True)
    if other_rank:  # exiting first, this rank would have torchrun stop rank 0 before it prints its line
        time.sleep(RANK_ZERO_GRACE_S)
    raise SystemExit(exit_status(e)) from None


@contextlib.contextmanager
def log_to_stderr(logger: str, prog: str):
    """While the block runs, INFO records of the logger ``logger`` go to stderr as
    ``<prog>: <message>`` (a CLI's notes: skipped files, resuming); restored afterwards."""
    log = logging.getLogger(logger)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: %(message)s"))
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
