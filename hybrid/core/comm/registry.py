"""The names of the algorithms: the fixed ones and their classes, ``auto``, and which take inter-node compression.

One place both :mod:`hybrid.core.comm.factory` (which builds them) and :mod:`hybrid.core.comm.auto`
(which chooses among the fixed ones) read, so neither imports the other to learn them.
"""

from __future__ import annotations

from hybrid.core.comm.base import Communicator
from hybrid.core.comm.flat import FlatCommunicator
from hybrid.core.comm.hierarchical import HierarchicalCommunicator
from hybrid.core.comm.sharded import ShardedCommunicator

__all__ = ["ALGORITHM_CLASSES", "AUTO", "CHOOSABLE", "COMPRESSIBLE"]

ALGORITHM_CLASSES: dict[str, type[Communicator]] = {
    cls.name: cls for cls in (FlatCommunicator, HierarchicalCommunicator, ShardedCommunicator)
}
# What make_communicator builds: a fixed algorithm, or auto (it picks among ALGORITHM_CLASSES per bucket size).
AUTO = "auto"
CHOOSABLE = (*ALGORITHM_CLASSES, AUTO)
# What comm.inter_compression applies to: the algorithms with an inter-node phase of their own, and auto
# (which passes it to its choices of them).
COMPRESSIBLE = (*(name for name, cls in ALGORITHM_CLASSES.items() if cls.compresses_inter), AUTO)
