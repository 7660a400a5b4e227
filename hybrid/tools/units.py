"""The byte and rate formatters, where the tools have always imported them from: they live in
:mod:`hybrid.core.units`, below every layer that prints a size."""

from hybrid.core.units import human_bytes, human_rate, human_size, parse_size

__all__ = ["human_bytes", "human_rate", "human_size", "parse_size"]
