"""Ctrl-C during start-up: stop at once, in one line, even where a library swallows it.

Before training starts (imports, config, data, engine set-up: minutes at scale) a SIGINT should
stop the command now. Python's default handler raises ``KeyboardInterrupt`` wherever the main
thread is, and code with a bare ``except:`` in the middle of start-up (in third-party imports and
compiler probes) can swallow it, so that the run trains on as if nothing happened. The handler
here raises it as Python's does and also remembers it: :func:`raise_if_swallowed`, called before
training starts (:class:`vitp.train.stop.StopSignal`), raises it again. From the first step on,
``StopSignal`` owns SIGINT (finish the step, checkpoint, exit 130).
"""
from __future__ import annotations

import signal
import sys
import threading

_pending = {"signal": None, "phase": "start-up"}


def _handle(signum, frame) -> None:
    _pending["signal"] = signal.Signals(signum).name
    raise KeyboardInterrupt(f"{_pending['signal']} during {_pending['phase']}")


def line(prog: str, error: BaseException) -> str:
    """The one line that reports the ``KeyboardInterrupt`` ``error`` of ``prog``."""
    why = str(error) or "SIGINT"
    if why.endswith("during start-up"):
        return f"{prog}: stopped by {why}, before the first step: nothing was trained; run the command again"
    return f"{prog}: {why}" if why.startswith("second signal") else f"{prog}: stopped by {why}"


def install(prog: str = "vitp-train") -> bool:
    """Handle SIGINT as above from now on (main thread only), and report a ``KeyboardInterrupt``
    nothing caught (one raised while ``python -m vitp.train`` imports its package) in one line
    (:func:`line`) instead of a traceback; Python then exits 130 as for any Ctrl-C. True if
    installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, _handle)
    previous = sys.excepthook

    def hook(kind, error, tb):
        if issubclass(kind, KeyboardInterrupt):
            print(line(prog, error), file=sys.stderr, flush=True)
        else:
            previous(kind, error, tb)

    sys.excepthook = hook
    return True


def raise_if_swallowed() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT arrived under :func:`install`'s handler (whether
    or not its exception was caught on the way); a no-op otherwise."""
    if _pending["signal"] is not None:
        raise KeyboardInterrupt(f"{_pending['signal']} during start-up")


def training_started() -> None:
    """Start-up is over (a later SIGINT under :func:`install`'s handler is "after training")."""
    _pending["phase"] = "the end of the run"


def clear() -> None:
    """Forget a SIGINT :func:`raise_if_swallowed` would raise (its exception was reported)."""
    _pending.update(signal=None, phase="start-up")
