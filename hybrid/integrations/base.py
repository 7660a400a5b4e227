"""What the two callbacks share (:class:`~hybrid.integrations.lightning.HybridCommCallback`,
:class:`~hybrid.integrations.transformers.HybridCommCallback`): the comm options, the communicator while
training, its counters, and closing it. Imports neither Lightning nor transformers: each callback's module
mixes this class into its library's callback class.
"""

from __future__ import annotations

from hybrid.core.attach import Attached, connect, refuses_unknown_options
from hybrid.core.comm import PhaseCounters
from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES

__all__ = ["CommCallback"]


class CommCallback:
    """The communicator of a trainer's fit: built by :meth:`_connect` once the process group exists, closed by
    :meth:`_close`. During and after training, :attr:`attached` is the communicator and its hooks (closed once
    training ends) and :attr:`counters` what travelled (seconds, bytes, calls per phase)."""

    @refuses_unknown_options()
    def __init__(self, algorithm: str = "hierarchical", *, intra_backend: str = "auto", inter_backend: str = "auto",
                 timeout_s: float = 300.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 inter_compression: str = "none") -> None:
        """Keep the options; the communicator is built when training starts.

        Args:
            algorithm: ``hierarchical``, ``sharded``, ``flat`` or ``auto`` (:func:`hybrid.attach`'s).
            intra_backend: the backend inside a node: ``auto`` (NCCL on CUDA, else gloo), ``gloo`` or ``nccl``.
            inter_backend: the backend between nodes, as ``intra_backend``.
            timeout_s: every collective's limit, seconds (> 0).
            chunk_bytes: the two-level algorithms' pipeline pieces, bytes (default 4 MiB).
            inter_compression: ``none``, ``bf16`` or ``fp16``: the inter-node hop only (two-level algorithms).
        """
        self.algorithm = algorithm
        self.comm_options = {"intra_backend": intra_backend, "inter_backend": inter_backend, "timeout_s": timeout_s,
                             "chunk_bytes": chunk_bytes, "inter_compression": inter_compression}
        self.attached: Attached | None = None

    @property
    def counters(self) -> PhaseCounters | None:
        return None if self.attached is None else self.attached.counters

    def _connect(self, node_rank: int | None = None) -> Attached:
        """A new communicator (the previous one closed first: a second fit with the same callback)."""
        self._close()
        self.attached = connect(self.algorithm, node_rank=node_rank, **self.comm_options)
        return self.attached

    def _close(self, timeout_s: float = 10.0) -> None:
        if self.attached is not None:
            self.attached.close(timeout_s)
