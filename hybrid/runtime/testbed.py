"""A real multi-node network on one Linux machine: nodes as network namespaces on shaped links.

Each simulated node is a network namespace with one "NIC" (``nic0``, one end
of a veth pair) whose other end is attached to a bridge in the root namespace
(the switch). Both ends are shaped with ``tc ... tbf``, so traffic between
nodes crosses a real bandwidth limit, while traffic between workers of one
node stays on that namespace's local path (fast, like NVLink in spirit). The
workers' gloo sockets bind to ``nic0`` and the ranks meet through a c10d
rendezvous on node 0's address: the same code path as a real cluster, with no
emulation in the training code.

Safety: addresses come from one private /24 used only inside namespaces this
module creates; the bridge has no address and no uplink, so nothing can leave
them. Every namespace, veth and bridge is removed on exit (also on an
exception, Ctrl-C or SIGTERM); names carry the creating process id, so a
leftover from a killed run is recognised and removed by the next one.

Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from types import FrameType, TracebackType

from hybrid.runtime.launch import NodeNetwork

__all__ = ["SUBNET", "LinkShape", "Testbed", "TestbedError", "cleanup_leftovers", "testbed_available"]

SUBNET = "10.213.57"  # .1 .. .N: node addresses, /24
NIC = "nic0"
_NS = re.compile(r"^hybrid-(\d+)-n(\d+)$")
_BRIDGE = re.compile(r"^hyb(\d+)br$")


class TestbedError(RuntimeError):
    """The testbed cannot be built here, or a command failed; the message says which."""


def testbed_available() -> str | None:
    """None if a testbed can be built here, else the reason why not."""
    if os.geteuid() != 0:
        return f"the network testbed needs root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network testbed needs iproute2: {', '.join(missing)} not found"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not available: {probe.stderr.strip()}"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    namespaces = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if m := _NS.match(name):
            namespaces.append((name, int(m.group(1))))
    bridges = []
    for line in _run("ip", "-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if m := _BRIDGE.match(name):
            bridges.append((name, int(m.group(1))))
    return namespaces, bridges


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and bridges of testbeds whose creating process is gone; return their names."""
    namespaces, bridges = _ours()
    removed = []
    for name, pid in namespaces:
        if not _alive(pid):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            removed.append(name)
    for name, pid in bridges:
        if not _alive(pid):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class LinkShape:
    """A token-bucket limit on each node's NIC, in both directions."""

    rate_mbit: float
    burst_kb: float = 0.0  # 0: enough for one 4 ms timer tick at the rate, at least 64 KB
    latency_ms: float = 50.0  # how long a packet may queue before tbf drops it

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"link_mbit={self.rate_mbit} must be > 0")
        if self.burst_kb < 0 or not self.latency_ms > 0:
            raise ValueError(f"burst_kb={self.burst_kb} must be >= 0 and latency_ms={self.latency_ms} > 0")

    def tbf_args(self) -> list[str]:
        burst = self.burst_kb or max(64.0, self.rate_mbit * 1e6 / 8 * 0.004 / 1024)
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", f"{burst:.0f}kb", "latency", f"{self.latency_ms:g}ms"]


class Testbed:
    """``with Testbed(2, LinkShape(500)) as tb: launch_local(layout, fn, nodes=tb.nodes)``."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, nnodes: int, link: LinkShape) -> None:
        if not 1 <= nnodes <= 200:
            raise ValueError(f"testbed nnodes={nnodes} must be in 1..200")
        self.nnodes, self.link = nnodes, link
        pid = os.getpid()
        self.bridge = f"hyb{pid}br"
        self.namespaces = [f"hybrid-{pid}-n{i}" for i in range(nnodes)]
        self._host_ends = [f"hyb{pid}n{i}" for i in range(nnodes)]
        self._previous_sigterm: object = None

    @property
    def nodes(self) -> list[NodeNetwork]:
        return [NodeNetwork(f"{SUBNET}.{i + 1}", NIC, ("ip", "netns", "exec", ns))
                for i, ns in enumerate(self.namespaces)]

    def __enter__(self) -> "Testbed":
        reason = testbed_available()
        if reason:
            raise TestbedError(reason)
        cleanup_leftovers()
        self._trap_sigterm()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i, (ns, host_end) in enumerate(zip(self.namespaces, self._host_ends)):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", NIC, "netns", ns)
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", NIC)
            _run("ip", "-n", ns, "link", "set", NIC, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Egress of the host end is the node's download; egress of nic0 its upload.
            _run("tc", "qdisc", "add", "dev", host_end, "root", *self.link.tbf_args())
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", NIC, "root", *self.link.tbf_args())

    def destroy(self) -> None:
        """Remove everything this testbed created (deleting a namespace deletes its veth pair)."""
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        for host_end in self._host_ends:
            subprocess.run(["ip", "link", "delete", host_end], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)
        self._restore_sigterm()

    def _trap_sigterm(self) -> None:
        # SIGTERM's default action skips `finally` blocks; turn it into SystemExit so
        # __exit__ runs. Only the main thread may install handlers.
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        except ValueError:
            self._previous_sigterm = None

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            self._previous_sigterm = None


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
