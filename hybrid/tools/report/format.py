"""Numbers as the report writes them: table cells (``-`` where there is no value) and durations in words.

Shared by the tables and the headline sentences, so a value reads the same wherever the report shows it.
"""

from __future__ import annotations

import math

__all__ = ["fmt", "ms"]


def fmt(value: float | None, scale: float = 1e3, digits: int = 1) -> str:
    """A table cell: ``value * scale`` to ``digits`` decimals (the default: seconds as ms), ``-`` where there is
    none or it is not finite, so a missing figure never reads as a number."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{round(value * scale, digits) + 0.0:.{digits}f}"  # + 0.0 turns -0.0 into 0.0: no '-0'


def ms(seconds: float) -> str:
    """A duration in the sentences: seconds from 1 s, else ms, with two significant digits below 10 ms."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"
