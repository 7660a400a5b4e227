"""One line, not a page of C++ stack traces, when a process loses the job's rendezvous store.

When the single c10d store of an elastic job dies (docs/reliability.md), every
agent and in-place worker that calls it next fails, and torch's TCPStore client
prints a C++ stack trace with each failed call: dozens of lines per process,
the cause buried. A :class:`StoreWatch` holds a connection of its own to the
store that carries nothing: the kernel closes it the moment the store's
process dies, before the process's next call to the store fails. The watch then
says what happened in one line and sends the rest of the process's output
(torch stopping its workers against a store that is gone) to a file that
line names.

On etcd, losing the store means losing a majority of its members, which the
Python client reports as a Python exception: there is no connection to watch,
and :meth:`StoreWatch.lost` says the line when that exception arrives.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["StoreWatch", "quiet_cpp_warnings"]

_ETCD = "etcd://"


_LEVEL_LOCK = threading.Lock()
_QUIET: list[int] = [0, 1]  # callers inside quiet_cpp_warnings, and the level to restore after the last one
_ERROR_LEVEL = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR


def _c10_log_level() -> Any:
    """c10's log level (``FLAGS_caffe2_log_level``, what ``TORCH_CPP_LOG_LEVEL`` sets at start), as a ctypes int
    to read and write; None where this torch does not export it."""
    global _LEVEL
    if _LEVEL is False:
        try:
            import ctypes

            import torch

            lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
            _LEVEL = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
        except (OSError, ValueError, ImportError):
            _LEVEL = None
    return _LEVEL


_LEVEL: Any = False


@contextmanager
def quiet_cpp_warnings() -> Iterator[None]:
    """c10's warnings off (errors still shown) while the body runs: around a heartbeat's calls to the store,
    whose failure when the store dies mid-call torch reports as a warning with a C++ stack trace before Python
    sees the error (the process then says it in one line). Process-wide for the call's microseconds."""
    level = _c10_log_level()
    if level is None:
        yield
        return
    with _LEVEL_LOCK:
        if _QUIET[0] == 0:
            _QUIET[1] = level.value
            level.value = max(level.value, _ERROR_LEVEL)
        _QUIET[0] += 1
    try:
        yield
    finally:
        with _LEVEL_LOCK:
            _QUIET[0] -= 1
            if _QUIET[0] == 0:
                level.value = _QUIET[1]


class StoreWatch:
    """Watch the store at ``endpoint`` (``HOST:PORT``; an ``etcd://`` one is not watched) for this process,
    named ``who`` in the line it says, which ends with ``then`` (what happens next)."""

    def __init__(self, who: str, endpoint: str, then: str) -> None:
        self.who, self.then, self.endpoint = who, then, endpoint.removeprefix(_ETCD)
        self._said: str | None = None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        if endpoint and not endpoint.startswith(_ETCD) and ":" in endpoint:
            host, port = endpoint.rsplit(":", 1)
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=10)
                self._sock.settimeout(None)
            except (OSError, ValueError):
                return  # not there now: the process's own call to it will say so
            threading.Thread(target=self._watch, name="hybrid-store-watch", daemon=True).start()

    @property
    def said(self) -> str | None:
        return self._said

    def _watch(self) -> None:
        sock = self._sock
        try:
            gone = sock is not None and sock.recv(1) == b""
        except OSError:
            gone = True
        if gone and self._sock is not None:  # not stopped meanwhile
            self.lost(ConnectionError("its process closed the connection"))

    def lost(self, exc: BaseException) -> str:
        """Say the line (once: the first cause stands) and send this process's output to a file from now on;
        return what was lost, for the caller's error."""
        with self._lock:
            if self._said is not None:
                return self._said
            root = exc.__cause__ or exc
            cause = str(root).splitlines()[0][:120] if str(root) else type(root).__name__
            self._said = f"lost the rendezvous store at {self.endpoint} ({cause})"
            log = Path(tempfile.gettempdir()) / f"hybrid-store-lost-{os.getpid()}.log"
            print(f"{self.who}: {self._said}: {self.then} (torch's report of that: {log})", file=sys.stderr,
                  flush=True)
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 2)
                os.dup2(fd, 1)
                os.close(fd)
            except OSError:
                pass  # no file: the report stays where it was going
            return self._said

    def stop(self) -> None:
        """Stop watching (the process is done with the store)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
