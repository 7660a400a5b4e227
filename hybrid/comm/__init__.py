"""The two-level gradient communicator.

Typical use inside any training loop (the process group already initialised)::

    topology = discover_topology()
    groups = CommGroups.build(topology, intra_backend="auto", inter_backend="auto")
    comm = make_communicator("hierarchical", groups)   # or "auto": per bucket size, from a calibrated model
    comm.all_reduce_mean_(grad_buffer)        # or, with DDP:
    hook = register_comm_hook(ddp_model, comm)

This package does not import Hydra, TensorBoard or anything that touches files.
"""

from hybrid.comm.auto import MODEL_LEVELS, AutoCommunicator, Decision, auto_group_kinds, measure_levels
from hybrid.comm.base import LOW_PRECISION, SUPPORTED_DTYPES, CommError, Communicator
from hybrid.comm.compression import INTER_COMPRESSIONS, InterCompressor
from hybrid.comm.counters import PHASES, PhaseCounters, PhaseStats
from hybrid.comm.ddp_hook import CommHookState, register_comm_hook, settle_buckets
from hybrid.comm.factory import ALGORITHMS, CHOOSABLE, group_kinds_for, make_communicator
from hybrid.comm.flat import FlatCommunicator
from hybrid.comm.groups import BACKENDS, GROUP_KINDS, CommGroups
from hybrid.comm.hierarchical import HierarchicalCommunicator
from hybrid.comm.ordered_stream import OrderedStream
from hybrid.comm.settings import COMM_CHOICES, CommSettings
from hybrid.comm.sharded import ShardedCommunicator

__all__ = [
    "ALGORITHMS",
    "AutoCommunicator",
    "BACKENDS",
    "CHOOSABLE",
    "COMM_CHOICES",
    "GROUP_KINDS",
    "INTER_COMPRESSIONS",
    "LOW_PRECISION",
    "MODEL_LEVELS",
    "PHASES",
    "SUPPORTED_DTYPES",
    "CommError",
    "CommGroups",
    "CommHookState",
    "CommSettings",
    "Communicator",
    "Decision",
    "FlatCommunicator",
    "HierarchicalCommunicator",
    "InterCompressor",
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
