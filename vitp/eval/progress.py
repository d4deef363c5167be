"""What a long evaluation phase is doing: a line naming it and a tqdm bar, on rank 0.

The final sample grid and evaluation of a run (and ``vitp-eval``) can take minutes after the
training bar reached 100 %: each phase (the held-out loss, sampling, training the digits judge)
logs one line saying what runs now and shows its own bar while :func:`reporting` is on. Outside
it (the evaluations during training, tests, library calls) phases are silent.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

log = logging.getLogger("vitp")

_state = {"lines": False, "bars": False, "prefix": ""}


@contextlib.contextmanager
def reporting(bars: bool, prefix: str = "final evaluation") -> Iterator[None]:
    """While the block runs, :func:`phase` logs its line (``<prefix>: <what>``) and, with ``bars``,
    shows a tqdm bar (the caller decides the rank: pass ``main`` to :func:`phase`)."""
    prev = dict(_state)
    _state.update(lines=True, bars=bars, prefix=prefix)
    try:
        yield
    finally:
        _state.update(prev)


def phase(what: str, total: int, desc: str, unit: str = "it", main: bool = True):
    """A tqdm bar of ``total`` units for the phase ``what`` (use it as a context manager and call
    ``update``); inside :func:`reporting` and on the ``main`` rank, first the line
    ``<prefix>: <what>``; the bar shows only with ``reporting(bars=True)``, and is cleared when done."""
    from tqdm import tqdm

    if main and _state["lines"]:
        log.info("%s: %s", _state["prefix"], what)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True,
                disable=not (main and _state["lines"] and _state["bars"]))
