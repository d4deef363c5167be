"""Command-line entry points (thin: parse, call the package, report bad input).

``vitp-train`` (:mod:`.train`), ``vitp-sample`` (:mod:`.sample`), ``vitp-eval`` (:mod:`.eval`),
``vitp-export`` (:mod:`.export`), ``vitp-sagemaker`` (:mod:`.sagemaker`), ``vitp-plan`` (:mod:`.plan`),
``vitp-sweep`` (:mod:`.sweep`). Every one takes config changes in one syntax, Hydra's
``key=value`` overrides checked by the schema (:mod:`.overrides`); flags are for paths and counts.
Bad input (missing or corrupt files, impossible layouts, wrong config values, a NaN loss) ends every
one of them the same way: one line ``<prog>: error: <message>`` and exit status 2, no traceback.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


def bad_input_errors() -> tuple:
    """Exception types that mean bad input, not a bug: reported in one line, exit status 2."""
    from omegaconf.errors import OmegaConfBaseException

    return ValueError, FileNotFoundError, FloatingPointError, OmegaConfBaseException


def run_cli(prog: str, fn: Callable[..., T], *args: Any, log: Optional[logging.Logger] = None) -> T:
    """``fn(*args)``; on bad input write ``<prog>: error: <message>`` (to ``log`` if given, so it
    also lands in the run's log file, else to stderr) and exit with status 2."""
    try:
        return fn(*args)
    except bad_input_errors() as e:
        if log is not None:
            log.error("%s: error: %s", prog, e)
        else:
            print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
