"""Join the job's default process group from torchrun's environment, and leave it.

Where the elastic agent does not share its own store with the workers
(``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``: :mod:`hybrid.runtime.launch` sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), rank 0 hosts the job's store. We
create that store ourselves, on a socket bound to ``MASTER_ADDR`` only
(torch's own would listen on every interface), and each (re)start of the
workers gets a fresh one, so a restarted attempt never reads the addresses
its failed predecessor left in a shared store.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid.core.topology import WorkerEnv

__all__ = ["all_gather_object", "broadcast_from_rank0", "cut_connections", "free_port", "init_distributed",
           "listening_socket", "open_descriptors", "shutdown_distributed", "socket_inodes"]


def init_distributed(timeout_s: float = 300.0, store: Any = None, env: WorkerEnv | None = None) -> WorkerEnv:
    """Initialise the default group (gloo on CPU; gloo for CPU + nccl for CUDA tensors).

    The default group carries only start-up exchanges and the training loop's
    own collectives; gradients travel on :class:`hybrid.core.comm.CommGroups`.
    ``store`` and ``env``: where the group meets and this process's place in it (default: torchrun's
    environment and the job's store); recovery in place gives both for each new membership.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
    env = env or WorkerEnv.from_env()
    if dist.is_initialized():
        return env
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    timeout = timedelta(seconds=timeout_s)
    store = store if store is not None else _job_store(env.rank, env.world_size, timeout)
    if store is None:
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    return env


_LISTENERS: list[socket.socket] = []  # the store's listening socket lives as long as the process


def _job_store(rank: int, world_size: int, timeout: timedelta) -> Any:
    """This job's TCPStore, hosted by rank 0 on MASTER_ADDR only; None where the agent's is shared."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_ADDR" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = listening_socket(host, port)
    _LISTENERS.append(listener)
    return dist.TCPStore(host, port, world_size, is_master=True, master_listen_fd=listener.fileno(),
                         wait_for_workers=False, timeout=timeout)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (for a rendezvous store or an etcd member)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` only, to hand to a TCPStore as ``master_listen_fd``.

    torch's TCPStore server would listen on every interface; given this
    socket, it serves on ``host``'s address alone.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1024)
    return listener


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` (any picklable object), on every rank. Collective over the default group."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank. Collective over the default
    group."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def shutdown_distributed() -> None:
    """Destroy every process group; safe to call on the failure path too."""
    if dist.is_initialized():
        dist.destroy_process_group()


def store_server(host: str, port: int, timeout_s: float) -> tuple[socket.socket, Any]:
    """A rendezvous store's server (torch's multi-tenant TCPStore) listening on ``host`` only: the socket and the
    store. The store closes the socket when it goes (node 0's agent, :mod:`hybrid.runtime.rdzv_store`). Port 0:
    one the system picks, held from the start (``listener.getsockname()[1]`` says which)."""
    from torch.distributed import TCPStore

    listener = listening_socket(host, port)
    store = TCPStore(host, listener.getsockname()[1], is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
                     wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return listener, store


def open_descriptors(kind: str) -> dict[int, str]:
    """This process's open descriptors of one kind (``socket:``, ``pipe:``), each with what it is
    (``socket:[inode]``), read from /proc/self/fd; empty where /proc is not there."""
    fds = Path("/proc/self/fd")
    found = {}
    for entry in list(fds.iterdir()) if fds.is_dir() else ():
        try:
            link = os.readlink(entry)
        except OSError:  # gone meanwhile (the listing's own descriptor among them)
            continue
        if link.startswith(kind):
            found[int(entry.name)] = link
    return found


def socket_inodes() -> set[str]:
    """The sockets this process holds now (``socket:[inode]``; empty where /proc is not there)."""
    return set(open_descriptors("socket:").values())


def cut_connections(keep: list[tuple[str, int]], spare: set[str]) -> int:
    """Shut down every connected TCP socket of this process except those to ``keep`` (the store, or each
    member of an etcd cluster) and those in
    ``spare`` (:func:`socket_inodes` taken before any group existed: a forked worker shares its agent's
    sockets, and shutting one down would cut the agent's too). This is what a gloo group's abort does not
    do: gloo closes a group's connections only when the last reference to the group goes, and a collective
    blocked on a peer fails only when that peer's connection closes, or at its timeout; a thread still
    blocked in one (DDP's hook, the ordered stream) holds such references. Shut down, every pending
    collective of this process fails at once, and so does every peer's that waits on it. Linux
    (/proc/self/fd); elsewhere nothing is cut. Returns how many were."""
    sockets = open_descriptors("socket:")
    if not sockets:
        return 0
    stores = {(socket.gethostbyname(host), port) for host, port in keep}
    cut = 0
    for fd, link in sockets.items():
        if link in spare:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):  # gone meanwhile, or a family Python does not know (netlink, say)
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                peer = sock.getpeername()[:2]
                if (peer[0], peer[1]) not in stores:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
        except OSError:
            pass  # not connected (a listening socket) or already shut
        finally:
            sock.close()  # the duplicate only: the group's own descriptor stays until gloo lets it go
    return cut
