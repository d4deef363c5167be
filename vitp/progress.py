"""Progress bars that suit where the output goes: tqdm's bar on a terminal, whole lines elsewhere.

tqdm redraws its bar with a carriage return at every update it shows. In a pipe or a log file
(``vitp-train ... 2>&1 | tee log``, SageMaker's CloudWatch, a Slurm output file) nothing erases the
old bar: each redraw stays, the final state comes twice (the last update and ``close``), a message
written with ``write`` brings the bar again, and a log record printed meanwhile lands on the bar's
line. :func:`progress_bar` keeps tqdm on a terminal and gives a :class:`LineProgress` elsewhere:
one line per state shown, at most one every :data:`LINE_INTERVAL_S` seconds, and the last at the end.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

LINE_INTERVAL_S = 30.0  # seconds between two progress lines outside a terminal
LINE_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class LineProgress:
    """tqdm's interface as used here (``update``, ``set_postfix``, ``write``, ``close``, a context
    manager) for output that is not a terminal. A line ``<desc>: 33% 1/3 [00:03<00:06, 3.19s/it,
    loss=...]`` is written at the first update, then at an update at least ``interval_s`` seconds
    after the last line, and at :meth:`close` when the count moved since the last line (``leave``
    or not: a log keeps how a phase ended). With ``disable`` no line is written (``write`` still
    prints its message, as tqdm's)."""

    def __init__(self, total: Optional[int], desc: str, unit: str = "it", initial: int = 0,
                 disable: bool = False, file: Optional[TextIO] = None, interval_s: Optional[float] = None):
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.disable, self.file, self.postfix = disable, file, ""
        self.interval_s = LINE_INTERVAL_S if interval_s is None else interval_s
        self._start = time.monotonic()
        self._shown_at: Optional[float] = None  # when the last line was written
        self._shown_n: Optional[int] = None  # its count
        self._closed = False

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _out(self) -> TextIO:
        return self.file or sys.stderr  # looked up when written: a test's capture, a redirected stderr

    def text(self) -> str:
        """The line for the current state (tqdm's numbers, without the bar)."""
        from tqdm import tqdm

        return tqdm.format_meter(self.n, self.total, time.monotonic() - self._start, prefix=self.desc, unit=self.unit,
                                 postfix=self.postfix or None, initial=self.initial,
                                 bar_format=LINE_FORMAT if self.total else None)

    def _show(self) -> None:
        print(self.text(), file=self._out(), flush=True)
        self._shown_at, self._shown_n = time.monotonic(), self.n

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units; write a line if it is the first or ``interval_s`` passed since the last."""
        self.n += n
        if self.disable or self._closed:
            return
        if self._shown_at is None or time.monotonic() - self._shown_at >= self.interval_s:
            self._show()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """Stats shown after the rate, ``key=value`` in key order (as tqdm); shown with the next line."""
        from tqdm import tqdm

        self.postfix = ", ".join(f"{k}={v if isinstance(v, str) else tqdm.format_num(v)}".strip()
                                 for k, v in sorted(values.items()))

    def write(self, message: str) -> None:
        """Print ``message`` on stdout, disabled or not, as tqdm's ``write`` does (nothing to erase
        or redraw here)."""
        print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Write the final state once, unless the last line already showed it."""
        if not (self.disable or self._closed) and self.n != self._shown_n:
            self._show()
        self._closed = True


def progress_bar(total: Optional[int], desc: str, unit: str = "it", initial: int = 0, disable: bool = False,
                 leave: bool = True, file: Optional[TextIO] = None) -> Any:
    """A tqdm bar of ``total`` units if ``file`` (default stderr) is a terminal, else a
    :class:`LineProgress` with the same arguments (``leave``: tqdm's, whether the bar stays after
    ``close``; a :class:`LineProgress` keeps its lines either way)."""
    out = file or sys.stderr
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable, leave=leave,
                    dynamic_ncols=True, file=file)
    return LineProgress(total, desc, unit, initial, disable, file)
