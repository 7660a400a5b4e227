"""A 3-member etcd cluster for a local or testbed job: ``cluster.rdzv_backend=etcd``.

torch's c10d rendezvous keeps an elastic job's membership in one TCPStore: one
process whose loss ends the job (docs/reliability.md). etcd is a replicated
store that loses nothing while a majority of its members lives; torchrun's
answer for long elastic jobs is its ``etcd-v2`` rendezvous backend. For a job it
launches itself, hybrid starts three members of Debian's ``etcd-server`` (3.4,
with the v2 API that torch's backend and the ``python-etcd`` client speak) on
loopback, or in the testbed's service namespace, beside the nodes; the agents
and the workers then meet there (:mod:`hybrid.runtime.etcd_store`). A member's
data lives in memory (``/dev/shm`` where there is one): the cluster lives and
dies with its job, and a member that goes is replaced by the others' copies,
not by its disk.

Given members (``cluster.rdzv_endpoint=H1:P1,H2:P2,H3:P3``), hybrid starts nothing
and uses them as they are.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EtcdCluster", "etcd_missing", "start_etcd"]

INSTALL = "apt-get install etcd-server; pip install python-etcd (or pip install 'hybrid[etcd]')"
# In a namespace of its own (the testbed's service network) every port is free.
NAMESPACE_PORTS = (2379, 2380)


def etcd_missing() -> str | None:
    """None if hybrid can start an etcd cluster and talk to it here, else why not (one line)."""
    if shutil.which("etcd") is None:
        return f"cluster.rdzv_backend=etcd needs the etcd server (not found on PATH): {INSTALL}"
    return etcd_client_missing()


def etcd_client_missing() -> str | None:
    """None if the ``python-etcd`` client (what torch's etcd rendezvous uses) imports, else why not."""
    try:
        import etcd  # noqa: F401
    except ImportError:
        return f"cluster.rdzv_backend=etcd needs the python-etcd client (import etcd failed): {INSTALL}"
    return None


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    process: subprocess.Popen | None = None


class EtcdCluster:
    """Members on ``host`` (inside ``prefix``, e.g. ``ip netns exec NS``); ``endpoint`` is what clients
    are given. ``stop()`` ends every member and removes their data."""

    def __init__(self, host: str, members: int = 3, prefix: tuple[str, ...] = ()) -> None:
        from hybrid.runtime.distributed import free_port

        self.host, self.prefix = host, prefix
        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
        self.base = Path(tempfile.mkdtemp(prefix="hybrid-etcd-", dir=base))
        self.token = self.base.name
        if prefix:
            ports = [(NAMESPACE_PORTS[0] + 10 * i, NAMESPACE_PORTS[1] + 10 * i) for i in range(members)]
        else:
            ports = [(free_port(host), free_port(host)) for _ in range(members)]
        self.members = [_Member(f"m{i}", c, p) for i, (c, p) in enumerate(ports)]

    @property
    def endpoint(self) -> str:
        """Every member, ``H1:P1,H2:P2,...``: what clients are given (the same shape as a single store's)."""
        return ",".join(f"{self.host}:{m.client_port}" for m in self.members)

    def pids(self) -> list[int]:
        return [m.process.pid for m in self.members if m.process is not None]

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each says it is healthy (at most ``timeout_s``); RuntimeError
        with the member's own last words where one does not."""
        everyone = ",".join(f"{m.name}=http://{self.host}:{m.peer_port}" for m in self.members)
        for m in self.members:
            log = (self.base / f"{m.name}.log").open("w")
            m.process = subprocess.Popen(
                [*self.prefix, "etcd", "--name", m.name, "--data-dir", str(self.base / m.name),
                 "--listen-client-urls", f"http://{self.host}:{m.client_port}",
                 "--advertise-client-urls", f"http://{self.host}:{m.client_port}",
                 "--listen-peer-urls", f"http://{self.host}:{m.peer_port}",
                 "--initial-advertise-peer-urls", f"http://{self.host}:{m.peer_port}",
                 "--initial-cluster", everyone, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.token, "--enable-v2", "--logger", "zap", "--log-level", "error"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        deadline = time.monotonic() + timeout_s
        for m in self.members:
            while not self._healthy(m):
                if m.process.poll() is not None or time.monotonic() > deadline:
                    said = (self.base / f"{m.name}.log").read_text().strip().splitlines()
                    self.stop()
                    raise RuntimeError(f"etcd member {m.name} on {self.host}:{m.client_port} did not start: "
                                       f"{said[-1] if said else f'not healthy within {timeout_s:g} s'}")
                time.sleep(0.1)
        return self

    def _healthy(self, m: _Member) -> bool:
        """Whether the member answers its health check (in the namespace, through the prefix)."""
        url = f"http://{self.host}:{m.client_port}/health"
        if self.prefix:
            probe = subprocess.run([*self.prefix, "python3", "-c",
                                    f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=2).read())"],
                                   capture_output=True, text=True, timeout=10)
            return '"true"' in probe.stdout
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    def stop(self, grace_s: float = 5.0) -> None:
        """End every member (SIGTERM, then SIGKILL after ``grace_s``) and remove the cluster's data."""
        for m in self.members:
            if m.process is not None and m.process.poll() is None:
                m.process.send_signal(signal.SIGTERM)
        for m in self.members:
            if m.process is None:
                continue
            try:
                m.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                m.process.kill()
                m.process.wait(timeout=grace_s)
        shutil.rmtree(self.base, ignore_errors=True)


def start_etcd(host: str, prefix: tuple[str, ...] = (), members: int = 3, timeout_s: float = 30.0) -> EtcdCluster:
    """A fresh etcd cluster of ``members`` on ``host`` (inside ``prefix``), healthy."""
    return EtcdCluster(host, members, prefix).start(timeout_s)
