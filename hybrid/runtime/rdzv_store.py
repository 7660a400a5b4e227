"""A rendezvous store that no training node hosts: ``python -m hybrid.runtime.rdzv_store HOST PORT``.

torch's c10d rendezvous keeps the job's membership in a TCPStore; under
torchrun (and in hybrid's launcher, by default) the agent of node 0 hosts it, so
losing node 0 loses the store and ends the job. torchrun's docs advise an
endpoint off the training nodes for elastic jobs; this is one: torch's own
TCPStore server (multi-tenant, listening on HOST only), in a small process of
its own. Every agent then joins as a client (``is_host`` false), and any node,
node 0 included, can be lost like any other.

It prints ``ready PORT`` once it listens (PORT 0 asks the system for a free
one, so that no other process can take it between choosing and binding), and
runs until its standard input closes (the launcher that started it exits, or
closes the pipe): it cannot outlive its job. hybrid's launcher forks the same
store from its fork server instead (:func:`start_store`; no interpreter to start),
which says its port on a pipe and ends at that pipe's end of file.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import IO

from hybrid.runtime.fork_server import ForkedProcess, fork, name_process
from hybrid.runtime.netns import NodeEntry, NodeNetwork, enter

__all__ = ["NODE_ENV", "PROCESS_NAME", "STORE_ENV", "StoreProcess", "serve", "start_store"]

READY = "ready"
# Where the workers of a job whose store is off the nodes find it (the agents export it): recovery in place
# (hybrid.app.state.in_place) agrees on memberships there, since no training node's store outlives every fault.
STORE_ENV = "HYBRID_RDZV_ENDPOINT"
# A node's name as hybrid's launcher numbers it (the agent exports it; the same when the node's agent starts again).
NODE_ENV = "HYBRID_NODE"
PROCESS_NAME = "hybrid-rdzv"  # ps -o comm: a forked store shares the fork server's command line


def serve(host: str, port: int) -> None:
    """Host the store on ``host:port`` until standard input closes (``python -m hybrid.runtime.rdzv_store``)."""
    from hybrid.runtime.distributed import store_server

    name_process(PROCESS_NAME)
    listener, store = store_server(host, port, 60.0)
    port = listener.getsockname()[1]
    listener.detach()  # the store owns the socket now, and closes it
    print(READY, port, flush=True)
    sys.stdin.read()  # until the launcher closes the pipe or exits
    del store


def _serve_forked(host: str, port: int, lifeline: Connection, entry: NodeEntry | None) -> None:
    """:func:`serve` in a process forked from the fork server: in its own session, inside ``entry``'s node if
    given; it says its port on ``lifeline`` (or why it cannot listen) and serves until the launcher's end of it
    closes."""
    os.setsid()
    name_process(PROCESS_NAME)
    try:
        if entry is not None:
            enter(entry)
        from hybrid.runtime.distributed import store_server

        listener, store = store_server(host, port, 60.0)
    except (OSError, RuntimeError) as exc:  # said to the launcher, which raises it in one line
        lifeline.send(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    port = listener.getsockname()[1]
    listener.detach()  # the store owns the socket now, and closes it
    lifeline.send(port)
    try:
        lifeline.recv()  # nothing is ever sent: this returns at the end of file
    except EOFError:
        pass
    del store


class StoreProcess:
    """The store's process, started by :func:`start_store`; ``stop()`` ends it (closing its lifeline: its stdin,
    or the pipe a forked store reads)."""

    def __init__(self, process: subprocess.Popen | ForkedProcess, endpoint: str, lifeline: IO | Connection) -> None:
        self.process, self.endpoint, self._lifeline = process, endpoint, lifeline

    def stop(self, timeout_s: float = 5.0) -> int:
        """End the store; its exit status (0: it ended as asked)."""
        self._lifeline.close()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=timeout_s)


def start_store(host: str, port: int, network: NodeNetwork | None = None, timeout_s: float = 30.0) -> StoreProcess:
    """Start the store on ``host:port`` (in ``network``, e.g. the testbed's service namespace; this machine's
    own network by default) and wait until it listens (at most ``timeout_s``); RuntimeError with its own words
    where it does not. ``port`` 0: a port the store binds itself, free for certain (a port chosen beforehand can
    be taken by then); ``endpoint`` says it. Forked from the fork server where it can be (no interpreter to
    start: :mod:`hybrid.runtime.fork_server`), else a command under ``network``'s prefix."""
    if network is None or network.forks:
        return _fork_store(host, port, network.entry if network else None, timeout_s)
    process = subprocess.Popen([*network.prefix, sys.executable, "-m", "hybrid.runtime.rdzv_store", host, str(port)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + timeout_s
    line = ""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([process.stdout], [], [], left)[0]:
            break  # nothing said in time
        line = process.stdout.readline()  # "ready PORT", or "" once it has exited
        if line.startswith(READY) or not line:
            break
    if not line.startswith(READY):
        process.kill()
        error = process.stderr.read().strip().splitlines()
        raise RuntimeError(f"the rendezvous store on {host}:{port} did not start: "
                           f"{error[-1] if error else 'no answer within ' + str(timeout_s) + ' s'}")
    return StoreProcess(process, f"{host}:{int(line.split()[1])}", process.stdin)


def _fork_store(host: str, port: int, entry: NodeEntry | None, timeout_s: float) -> StoreProcess:
    mine, theirs = Pipe()
    process = fork(_serve_forked, (host, port, theirs, entry), PROCESS_NAME)
    theirs.close()  # the store's end is the store's alone: it sees the end of file when this process lets go
    said: object = f"no answer within {timeout_s} s"
    try:
        if mine.poll(timeout_s):
            said = mine.recv()
    except EOFError:
        said = "it exited before it listened"
    if not isinstance(said, int):
        mine.close()
        process.kill()
        process.wait(timeout=10)
        raise RuntimeError(f"the rendezvous store on {host}:{port} did not start: {said}")
    return StoreProcess(process, f"{host}:{said}", mine)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
