"""What a long evaluation phase is doing: a line naming it and a progress bar, on rank 0.

The final sample grid and evaluation of a run (and ``vitp-eval``) can take minutes after the
training bar reached 100 %: each phase (the held-out loss, sampling, training the digits judge)
logs one line saying what runs now and shows its own bar while :func:`reporting` is on. Outside
it (the evaluations during training, tests, library calls) phases are silent.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

log = logging.getLogger("vitp")

_state = {"lines": False, "bars": False, "prefix": "", "stop": None}


class EvaluationStopped(Exception):
    """A stop request ended an evaluation phase: every rank raises it after the same forward
    (:func:`check_stop`), so no collective is left half-done."""


@contextlib.contextmanager
def stoppable(check: Callable[[], bool]) -> Iterator[None]:
    """While the block runs, the held-out loss and sampling ask ``check()`` after each forward
    that every replica runs (:func:`check_stop`) and raise :class:`EvaluationStopped` when it
    returns true. ``check`` must be collective over the world: every rank calls it at the same
    forwards (``vitp.train.stop.StopSignal.requested``)."""
    prev = _state["stop"]
    _state["stop"] = check
    try:
        yield
    finally:
        _state["stop"] = prev


def check_stop(collective: bool) -> None:
    """After a forward: raise :class:`EvaluationStopped` if a stop was requested (inside
    :func:`stoppable`). ``collective``: every rank of the world reaches this forward (the forwards
    every replica runs, :func:`common_batches`); elsewhere nothing is asked, since a rank that
    stopped alone would leave its replica's peers in a collective."""
    check = _state["stop"]
    if collective and check is not None and check():
        raise EvaluationStopped


def common_batches(n: int, replicas: int, batch_size: int) -> int:
    """The batches every replica runs when ``n`` items are split into contiguous ranges of
    ``ceil(n / replicas)`` (:meth:`vitp.eval.inference.Share.indices`), ``batch_size`` at a time."""
    per = -(-n // replicas)
    return min(-(-max(0, min(n, (r + 1) * per) - min(n, r * per)) // batch_size) for r in range(replicas))


@contextlib.contextmanager
def reporting(bars: bool, prefix: str = "final evaluation") -> Iterator[None]:
    """While the block runs, :func:`phase` logs its line (``<prefix>: <what>``) and, with ``bars``,
    shows a progress bar (the caller decides the rank: pass ``main`` to :func:`phase`)."""
    prev = dict(_state)
    _state.update(lines=True, bars=bars, prefix=prefix)
    try:
        yield
    finally:
        _state.update(prev)


def phase(what: str, total: int, desc: str, unit: str = "it", main: bool = True):
    """A progress bar of ``total`` units for the phase ``what`` (:func:`vitp.progress.progress_bar`:
    tqdm on a terminal, else lines; use it as a context manager and call ``update``); inside
    :func:`reporting` and on the ``main`` rank, first the line ``<prefix>: <what>``; the bar shows
    only with ``reporting(bars=True)``, and a terminal's is cleared when done."""
    from vitp.progress import progress_bar

    if main and _state["lines"]:
        log.info("%s: %s", _state["prefix"], what)
    return progress_bar(total, desc, unit, leave=False, disable=not (main and _state["lines"] and _state["bars"]))
