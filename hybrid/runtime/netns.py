"""Where a simulated node runs (:class:`NodeNetwork`), and how a forked process enters a testbed node, as
``ip netns exec`` enters it for a new command.

A node of the testbed (:mod:`hybrid.runtime.testbed`) is a named network
namespace, and its agent used to start as ``ip netns exec NS python -m
hybrid.runtime.agent``: a fresh interpreter that imports torch, about 2.5 CPU
seconds per agent, every launch. An agent forked from the launcher's fork
server (which has torch imported) and moved into the node here costs a
fraction of that, and runs in the same place:

- the node's cgroup first, where it has a CPU limit (``/sys/fs/cgroup`` is
  still the machine's then);
- the network namespace (``setns`` on ``/run/netns/NS``);
- a mount namespace of its own, whose mounts do not propagate back, with a
  ``/sys`` that shows the node's network devices (its NICs' byte counters)
  and the files of ``/etc/netns/NS`` bound over ``/etc`` (the testbed's
  ``hosts``, which c10d's name lookups need).

This is what iproute2's ``ip netns exec`` does (``netns_switch`` in its
lib/namespace.c). Python 3.11 has no ``os.setns``, so the system calls go
through libc with :mod:`ctypes`. Needs root (CAP_SYS_ADMIN); a testbed in a
user namespace (no root) starts its agents with its command prefix instead.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NETNS_ETC", "NETNS_RUN", "NodeEntry", "NodeNetwork", "enter"]

NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")

# From <sched.h> and <sys/mount.h>.
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_BIND = 4096
_MS_REC = 16384
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


@dataclass(frozen=True)
class NodeEntry:
    """How a forked process becomes part of a testbed node: its network namespace's name and, where the node
    has a CPU limit, its cgroup's directory."""

    netns: str
    cgroup: str = ""


@dataclass(frozen=True)
class NodeNetwork:
    """Where one simulated node runs: its address, the NIC gloo binds to, how to enter it."""

    address: str
    ifname: str
    prefix: tuple[str, ...] = ()  # a command under it runs in the node, e.g. ("ip", "netns", "exec", "hybrid-n0")
    # The same place for a process forked here (a testbed made as root): entered in the child, no new interpreter.
    entry: NodeEntry | None = None


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter(entry: NodeEntry) -> None:
    """Move this process into ``entry``'s node, for good: call it in a fresh, single-threaded child (a
    thread that already runs stays outside). OSError, naming the step, where the system refuses."""
    if entry.cgroup:
        (Path(entry.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    libc = _libc()
    fd = os.open(NETNS_RUN / entry.netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into network namespace {entry.netns}")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    _check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "make / a slave mount")
    flags = 0
    if libc.umount2(b"/sys", _MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = _MS_RDONLY  # a read-only /sys that could not be unmounted can only be covered read-only
    _check(libc.mount(entry.netns.encode(), b"/sys", b"sysfs", flags, None), "mount the namespace's /sys")
    etc = NETNS_ETC / entry.netns
    for name in sorted(os.listdir(etc)) if etc.is_dir() else []:
        _check(libc.mount(str(etc / name).encode(), f"/etc/{name}".encode(), b"none", _MS_BIND, None),
               f"bind {etc / name} over /etc/{name}")
