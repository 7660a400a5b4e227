"""The two-level gradient communicator.

Typical use inside any training loop (the process group already initialised)::

    topology = discover_topology()
    groups = CommGroups.build(topology, intra_backend="auto", inter_backend="auto")
    comm = make_communicator("hierarchical", groups)   # or "auto": per bucket size, from a calibrated model
    comm.all_reduce_mean_(grad_buffer)        # or, with DDP:
    hook = register_comm_hook(ddp_model, comm)

This package does not import Hydra, TensorBoard or anything that touches files.
"""

from hybrid.core.comm.auto import MODEL_LEVELS, AutoCommunicator, Decision, auto_group_kinds, measure_levels
from hybrid.core.comm.base import LOW_PRECISION, SUPPORTED_DTYPES, CommError, Communicator, comm_error
from hybrid.core.comm.compression import INTER_COMPRESSIONS, InterCompressor
from hybrid.core.comm.counters import PHASES, PhaseCounters, PhaseStats
from hybrid.core.comm.ddp_hook import CommHookState, register_comm_hook, settle_buckets
from hybrid.core.comm.factory import group_kinds_for, make_communicator
from hybrid.core.comm.flat import FlatCommunicator
from hybrid.core.comm.groups import BACKENDS, GROUP_KINDS, CommGroups
from hybrid.core.comm.hierarchical import HierarchicalCommunicator
from hybrid.core.comm.ordered_stream import OrderedStream
from hybrid.core.comm.registry import ALGORITHM_CLASSES, CHOOSABLE
from hybrid.core.comm.sharded import NodeCommunicator, ShardedCommunicator

__all__ = [
    "ALGORITHM_CLASSES",
    "AutoCommunicator",
    "BACKENDS",
    "CHOOSABLE",
    "GROUP_KINDS",
    "INTER_COMPRESSIONS",
    "LOW_PRECISION",
    "MODEL_LEVELS",
    "PHASES",
    "SUPPORTED_DTYPES",
    "CommError",
    "comm_error",
    "CommGroups",
    "CommHookState",
    "Communicator",
    "Decision",
    "FlatCommunicator",
    "HierarchicalCommunicator",
    "InterCompressor",
    "NodeCommunicator",
    "OrderedStream",
    "PhaseCounters",
    "PhaseStats",
    "ShardedCommunicator",
    "auto_group_kinds",
    "group_kinds_for",
    "make_communicator",
    "measure_levels",
    "register_comm_hook",
    "settle_buckets",
]
