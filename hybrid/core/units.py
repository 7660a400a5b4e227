"""Byte sizes as people write them on a command line (``25M``) and read them in prose; link rates as people
read them. The one place sizes are formatted: every layer's messages (the run log, start-up refusals, the
report, the benchmarks) say bytes with :func:`human_bytes`, so they read alike."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "human_rate", "human_size", "parse_size"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``'25M'`` -> 26214400 bytes (binary units K, M, G; an optional trailing B)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"size {text!r} is not understood: use bytes or K/M/G units, e.g. 1M,25M")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
    if nbytes <= 0:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return nbytes


def human_size(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def human_bytes(nbytes: float) -> str:
    """``26214400`` -> ``'25 MiB'``, ``2.6e9`` -> ``'2.42 GiB'``: three significant figures in the binary unit that
    keeps the number between 1 and 1024, for prose (:func:`human_size` is for command lines)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def human_rate(mbit_per_s: float) -> str:
    """``500`` -> ``'500 Mbit/s'``, ``2340`` -> ``'2.34 Gbit/s'``: three significant figures, the unit that keeps
    the number between 1 and 1000."""
    value = float(f"{mbit_per_s:.3g}")  # rounded first: 999.7 is 1 Gbit/s, not 1e+03 Mbit/s
    for unit, scale in (("Tbit/s", 1e6), ("Gbit/s", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} Mbit/s"
