"""The communicator's options checked in one place: :class:`hybrid.core.attach.CommOptions` (``hybrid.attach``)
and the trainer's ``CommConfig`` (:mod:`hybrid.app.config`) both call :func:`check_comm_options`, so a bad
value is refused in the same words whichever way it came in: one line naming the key, the value and what is
allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybrid.core.comm.compression import INTER_COMPRESSIONS
from hybrid.core.comm.groups import BACKENDS
from hybrid.core.comm.registry import CHOOSABLE, COMPRESSIBLE

__all__ = ["check_comm_options", "one_of"]


def one_of(key: str, value: Any, allowed: Sequence[str], note: str = "") -> None:
    """ValueError ``key='value' is not one of a, b, c`` (and ``note``) where ``value`` is not in ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}{note}")


def check_comm_options(*, algorithm: str, intra_backend: str, inter_backend: str, timeout_s: float,
                       chunk_bytes: int, inter_compression: str | None, algorithms: Sequence[str] = CHOOSABLE,
                       prefix: str = "", algorithm_key: str = "algorithm",
                       elsewhere: Mapping[str, str] | None = None) -> None:
    """Refuse a bad comm option with a one-line ValueError.

    Args:
        algorithm, intra_backend, inter_backend, timeout_s, chunk_bytes, inter_compression: the options.
            ``inter_compression=None``: ``algorithm`` checks codecs of its own (the trainer's diloco).
        algorithms: the algorithms the caller serves (``hybrid.attach``: flat, hierarchical, sharded, auto).
        prefix: what the keys are named with in messages (``"comm."`` for the trainer's config).
        algorithm_key: the key that names the algorithm (``"comm"`` for the trainer: ``comm=flat``).
        elsewhere: compressions another of the caller's algorithms takes (``{"fp8": "diloco"}``), said as a hint.
    """
    one_of(algorithm_key, algorithm, algorithms)
    for level, backend in (("intra", intra_backend), ("inter", inter_backend)):
        one_of(f"{prefix}{level}_backend", backend, BACKENDS)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{prefix}timeout_s={timeout_s!r} must be > 0 seconds")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"{prefix}chunk_bytes={chunk_bytes!r} must be a positive number of bytes")
    if inter_compression is None:
        return
    owner = (elsewhere or {}).get(inter_compression)
    one_of(f"{prefix}inter_compression", inter_compression, INTER_COMPRESSIONS,
           f" ({inter_compression} is {algorithm_key}={owner}'s)" if owner else "")
    if inter_compression != "none" and algorithm not in COMPRESSIBLE:
        raise ValueError(f"{prefix}inter_compression={inter_compression!r} compresses the inter-node phase of "
                         f"hierarchical and sharded (and auto's choices of them); {algorithm_key}={algorithm} has "
                         "none: use none")
