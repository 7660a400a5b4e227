"""Byte sizes as people write them on a command line (``25M``) and read them in a table."""

from __future__ import annotations

import re

__all__ = ["human_size", "parse_size"]

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
