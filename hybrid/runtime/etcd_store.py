"""The control plane's store on etcd: what agents and workers connect to with ``cluster.rdzv_backend=etcd``.

The agents rendezvous through torch's own ``etcd-v2`` backend (torch's dynamic
rendezvous, its state in etcd), and the workers' quorum for recovery in place
(:mod:`hybrid.runtime.quorum`) runs on torch's ``EtcdStore``, the c10d store
that backend hands its agents, under the same keys, so that an agent's exit
barrier and its workers read one store. The only thing the quorum needs that
``EtcdStore`` lacks is ``compare_set`` (one decision per epoch); etcd's own
compare-and-swap (``prevExist``/``prevValue``) gives it.

Losing a member is invisible to both: the ``python-etcd`` client learns the
cluster's members from the one it is given and moves to another when its
member stops answering (``allow_reconnect``). A client is therefore given every
member it may have to start from: ``etcd://H1:P1,H2:P2,H3:P3``, as
``HYBRID_RDZV_ENDPOINT`` reaches the workers.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["ETCD_SCHEME", "RETRY_S", "STORE_PREFIX", "QuorumEtcdStore", "connect_store", "etcd_client", "is_etcd",
           "is_transient", "live_member", "members_of", "retrying"]

ETCD_SCHEME = "etcd://"
# Where torch's etcd-v2 rendezvous keeps the store it hands the agents (torch.distributed.elastic.rendezvous.
# etcd_rendezvous_backend.create_backend): the workers' store is the same one.
STORE_PREFIX = "/torch/elastic/store"


def is_etcd(endpoint: str) -> bool:
    return endpoint.startswith(ETCD_SCHEME)


def members_of(endpoint: str) -> list[tuple[str, int]]:
    """``etcd://H1:P1,H2:P2`` (or ``H1:P1,H2:P2``) as (host, port) pairs; ValueError naming a bad one."""
    members = []
    for part in endpoint.removeprefix(ETCD_SCHEME).split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"etcd member {part!r} must be HOST:PORT (a port 1-65535)")
        members.append((host, int(port)))
    return members


def etcd_client(members: list[tuple[str, int]], read_timeout_s: float = 60.0) -> Any:
    """A ``python-etcd`` client that starts from the first member that answers and fails over to the others."""
    import etcd

    return etcd.Client(host=tuple(members), allow_reconnect=True, read_timeout=max(1, int(read_timeout_s)))


def live_member(endpoint: str, timeout_s: float = 5.0) -> str:
    """``HOST:PORT`` of the first member of ``endpoint`` that answers, for torch's etcd-v2 rendezvous (which takes
    one, and learns the others from it); RuntimeError naming them all where none does."""
    import urllib.request

    members = members_of(endpoint)
    for host, port in members:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout_s) as answer:
                if b'"true"' in answer.read():
                    return f"{host}:{port}"
        except OSError:
            continue
    raise RuntimeError(f"no etcd member of {endpoint} answers (is a majority of the cluster up?)")


# How long a call rides out a member's loss: the client moves to another member at once, but while the cluster
# elects a new leader (about a second by default; longer on a busy machine) a write is answered "Raft Internal
# Error: request timed out" or "leader election in progress".
RETRY_S = 15.0


def is_transient(exc: BaseException) -> bool:
    """Whether an etcd error is a member's loss the cluster recovers from (a leader election, a member that went),
    rather than an answer."""
    import etcd

    if isinstance(exc, (etcd.EtcdConnectionFailed, etcd.EtcdLeaderElectionInProgress)):
        return True
    text = str(exc)
    return isinstance(exc, etcd.EtcdException) and ("Raft Internal Error" in text or "timed out" in text
                                                    or "leader" in text.lower())


def retrying(call: Any, retry_s: float = RETRY_S) -> Any:
    """``call`` made again, every 0.1 s, while it fails with :func:`is_transient` errors, for at most ``retry_s``."""
    import functools
    import time

    @functools.wraps(call)
    def again(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return call(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the transient kinds are told apart below
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                if not (is_transient(exc) or is_transient(cause)) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    return again


def _store_class() -> type:
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    class _QuorumEtcdStore(EtcdStore):
        """torch's EtcdStore with ``compare_set`` (c10d's semantics: ``expected`` empty writes where the key
        is absent), from etcd's compare-and-swap; every call rides out a leader election (:func:`retrying`)."""

        set = retrying(EtcdStore.set)
        get = retrying(EtcdStore.get)
        add = retrying(EtcdStore.add)
        check = retrying(EtcdStore.check)
        wait = retrying(EtcdStore.wait)

        @retrying
        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            import etcd

            path = self.prefix + self._encode(key)
            new = self._encode(desired)
            try:
                if expected in ("", b""):
                    self.client.write(key=path, value=new, prevExist=False)
                else:
                    self.client.test_and_set(key=path, value=new, prev_value=self._encode(expected))
                return desired.encode() if isinstance(desired, str) else desired
            except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                try:
                    return self._decode(self.client.read(path).value)
                except etcd.EtcdKeyNotFound:
                    return expected.encode() if isinstance(expected, str) else expected

    return _QuorumEtcdStore


def QuorumEtcdStore(endpoint: str, timeout: timedelta) -> Any:  # noqa: N802 - a class, built on first use
    """torch's ``EtcdStore`` on the cluster at ``endpoint`` with ``compare_set``, under :data:`STORE_PREFIX`."""
    return _store_class()(etcd_client(members_of(endpoint), timeout.total_seconds()), STORE_PREFIX, timeout)


def connect_store(endpoint: str, timeout: timedelta) -> Any:
    """A client of the job's control-plane store: etcd (``etcd://...``) or a c10d TCPStore (``HOST:PORT``)."""
    if is_etcd(endpoint):
        return QuorumEtcdStore(endpoint, timeout)
    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
