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
closes the pipe): it cannot outlive its job.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time

__all__ = ["NODE_ENV", "STORE_ENV", "StoreProcess", "start_store", "serve"]

READY = "ready"
# Where the workers of a job whose store is off the nodes find it (the agents export it): recovery in place
# (hybrid.app.state.in_place) agrees on memberships there, since no training node's store outlives every fault.
STORE_ENV = "HYBRID_RDZV_ENDPOINT"
# A node's name as hybrid's launcher numbers it (the agent exports it; the same when the node's agent starts again).
NODE_ENV = "HYBRID_NODE"


def serve(host: str, port: int) -> None:
    """Host the store on ``host:port`` until standard input closes."""
    from hybrid.runtime.distributed import store_server

    listener, store = store_server(host, port, 60.0)
    port = listener.getsockname()[1]
    listener.detach()  # the store owns the socket now, and closes it
    print(READY, port, flush=True)
    sys.stdin.read()  # until the launcher closes the pipe or exits
    del store


class StoreProcess:
    """The store's process, started by :func:`start_store`; ``stop()`` ends it (closing its stdin)."""

    def __init__(self, process: subprocess.Popen, endpoint: str) -> None:
        self.process, self.endpoint = process, endpoint

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)


def start_store(host: str, port: int, prefix: tuple[str, ...] = (), timeout_s: float = 30.0) -> StoreProcess:
    """Start the store on ``host:port`` (inside ``prefix``, e.g. a network namespace's ``ip netns exec``) and wait
    until it listens (at most ``timeout_s``); RuntimeError with its own words where it does not. ``port`` 0: a port
    the store binds itself, free for certain (a port chosen beforehand can be taken by then); ``endpoint`` says it."""
    process = subprocess.Popen([*prefix, sys.executable, "-m", "hybrid.runtime.rdzv_store", host, str(port)],
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
    return StoreProcess(process, f"{host}:{int(line.split()[1])}")


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
