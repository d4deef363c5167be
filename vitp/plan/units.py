"""How the planner writes sizes: bytes with three significant digits in a binary unit."""
from __future__ import annotations

import math

GIB = 2**30
_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``n`` bytes with three significant digits in the largest binary unit (B, KiB, MiB, GiB,
    TiB; 1 KiB = 1024 B) that keeps the number below 1000: ``0 B``, ``12 B``, ``1.50 KiB``,
    ``0.977 KiB`` (1000 B), ``31.9 MiB``, ``140 GiB``, ``2.91 TiB``. Whole bytes below 1000 B; a
    size of 1000 TiB or more keeps TiB (``1234 TiB``).

    Raises ``ValueError`` for a negative or non-finite ``n``.
    """
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"format_bytes({n!r}): a size is a finite number of bytes >= 0")
    if round(n) < 1000:
        return f"{round(n)} B"
    value, unit = float(n), "B"
    for unit in _UNITS:
        value /= 1024
        if float(f"{value:.3g}") < 1000:
            break
    value = float(f"{value:.3g}") if value < 1000 else round(value)
    decimals = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{value:.{decimals}f} {unit}"
