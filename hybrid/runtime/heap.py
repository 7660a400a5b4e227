"""The C heap of a long-lived worker: few arenas, and freed memory given back.

A worker that loses and regains peers in place (:mod:`hybrid.app.state.in_place`) builds new process groups,
whose gloo threads allocate in glibc's per-thread arenas (up to 8 per core). Each arena keeps what it once held,
so without a limit a long run's resident set creeps up a few MB per loss and return (+1.9% to +2.6% over 5,000
steps of 2x2 with four returns, experiments/recovery/soak.py; with two arenas under 1.5%, and no slower:
experiments/RESULTS.md 8.3). Elsewhere (another C library) nothing is done.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["ARENAS", "limit_arenas", "trim_heap"]

ARENAS = 2  # glibc's MALLOC_ARENA_MAX, where the environment does not set it
_M_ARENA_MAX = -8  # mallopt's parameter number for it (malloc.h)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most ``arenas`` malloc arenas in this process (call it before the threads start), unless
    ``MALLOC_ARENA_MAX`` is set, which glibc reads itself. Whether the limit was set."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``): after a recovery has dropped a
    session's groups and buffers, the heap would otherwise stay at its high-water mark."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
