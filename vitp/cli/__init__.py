"""Command-line entry points (thin: parse, call the package, report bad input).

``vitp-train`` (:mod:`.train`), ``vitp-sample`` (:mod:`.sample`), ``vitp-eval`` (:mod:`.eval`),
``vitp-export`` (:mod:`.export`), ``vitp-sagemaker`` (:mod:`.sagemaker`), ``vitp-plan`` (:mod:`.plan`),
``vitp-sweep`` (:mod:`.sweep`). Every one takes config changes in one syntax, Hydra's
``key=value`` overrides checked by the schema (:mod:`.overrides`); flags are for paths and counts.
Bad input (missing or corrupt files, impossible layouts, wrong config values) ends every one of
them the same way: one line ``<prog>: error: <message>`` and exit status 2
(:data:`EXIT_BAD_INPUT`), no traceback. A training whose loss turned NaN or infinite ends the
same way with exit status 3 (:data:`EXIT_NON_FINITE`), the message saying where the non-finite
value first appeared (:mod:`vitp.train.nonfinite`). Any other error is a bug: a traceback and
exit status 1.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


EXIT_BAD_INPUT = 2  # bad input: missing or corrupt files, impossible layouts, wrong config values
EXIT_NON_FINITE = 3  # the training loss turned NaN or infinite (FloatingPointError)


def bad_input_errors() -> tuple:
    """Exception types that mean bad input, not a bug: reported in one line, exit status 2."""
    from omegaconf.errors import OmegaConfBaseException

    return ValueError, FileNotFoundError, OmegaConfBaseException


def reported_errors() -> tuple:
    """Exception types reported in one line without a traceback: bad input and a non-finite loss."""
    return (*bad_input_errors(), FloatingPointError)


def exit_status(error: BaseException) -> int:
    """The exit status for a :func:`reported_errors` instance: 3 for a non-finite loss, else 2."""
    return EXIT_NON_FINITE if isinstance(error, FloatingPointError) else EXIT_BAD_INPUT


def run_cli(prog: str, fn: Callable[..., T], *args: Any, log: Optional[logging.Logger] = None) -> T:
    """``fn(*args)``; on bad input or a non-finite loss write ``<prog>: error: <message>`` (to
    ``log`` if given, so it also lands in the run's log file, else to stderr) and exit with
    :func:`exit_status` (2, or 3 for a non-finite loss)."""
    try:
        return fn(*args)
    except reported_errors() as e:
        if log is not None:
            log.error("%s: error: %s", prog, e)
        else:
            print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(exit_status(e)) from None
