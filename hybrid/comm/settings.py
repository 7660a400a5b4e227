"""Plain, validated communicator settings: what the Hydra ``comm`` group turns into at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.comm.compression import INTER_COMPRESSIONS
from hybrid.comm.factory import CHOOSABLE, COMPRESSIBLE
from hybrid.comm.groups import BACKENDS

__all__ = ["COMM_CHOICES", "CommSettings"]

# "ddp" is torch DDP's own all-reduce (no hook): the reference every algorithm is checked against;
# "auto" picks flat, hierarchical or sharded per bucket size from a cost model calibrated at start-up.
COMM_CHOICES = (*CHOOSABLE, "ddp")


@dataclass
class CommSettings:
    """How gradients travel; also the schema of the Hydra ``comm`` group."""

    algorithm: str = "hierarchical"
    bucket_mb: float = 25.0
    intra_backend: str = "auto"
    inter_backend: str = "auto"
    timeout_s: float = 300.0
    pipeline_chunk_mb: float = 4.0  # two-level algorithms pipeline large buckets in pieces of this size
    # DDP's gradient_as_bucket_view: gradients live inside the buckets, so no copy
    # of every gradient into its bucket and back after the all-reduce, and no
    # second full-size gradient buffer (the trainer zeroes gradients in place so they
    # stay views). Applies to every comm, ddp included.
    grad_as_bucket_view: bool = True
    # none | bf16 | fp16: the inter-node all-reduce of hierarchical / sharded travels in 16 bits, with
    # error feedback; the intra-node phases stay full precision.
    inter_compression: str = "none"

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.pipeline_chunk_mb * 2**20))

    def __post_init__(self) -> None:
        if self.algorithm not in COMM_CHOICES:
            raise ValueError(f"comm.algorithm={self.algorithm!r} is not one of {', '.join(COMM_CHOICES)}")
        for level in ("intra", "inter"):
            value = getattr(self, f"{level}_backend")
            if value not in BACKENDS:
                raise ValueError(f"comm.{level}_backend={value!r} is not one of {', '.join(BACKENDS)}")
        if self.inter_compression not in INTER_COMPRESSIONS:
            raise ValueError(f"comm.inter_compression={self.inter_compression!r} is not one of "
                             f"{', '.join(INTER_COMPRESSIONS)}")
        if self.inter_compression != "none" and self.algorithm not in COMPRESSIBLE:
            raise ValueError(f"comm.inter_compression={self.inter_compression!r} compresses the inter-node phase of "
                             f"hierarchical and sharded (and auto's choices of them); comm={self.algorithm} has "
                             "none: use none")
        if not self.bucket_mb > 0:
            raise ValueError(f"comm.bucket_mb={self.bucket_mb} must be > 0 (MiB per DDP bucket)")
        if not self.pipeline_chunk_mb > 0:
            raise ValueError(f"comm.pipeline_chunk_mb={self.pipeline_chunk_mb} must be > 0")
        if not self.timeout_s > 0:
            raise ValueError(f"comm.timeout_s={self.timeout_s} must be > 0 seconds")
