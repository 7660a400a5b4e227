"""A run's state held in memory, for recovery in place (``cluster.recovery=in_place``).

When a collective fails because a peer died, the surviving workers keep their
processes and their state. What they continue from is the last step each one
completed (:class:`Progress`, kept up to date by the training loop): a failure
inside a step leaves the model, optimizer and schedule as they were after the
step before (the gradients are thrown away), a failure after a step's update
leaves them after it. The survivors agree on who is in and which of them has
completed the most steps; that one's :class:`HeldState` travels to every other
over the new group, exactly as a checkpoint would from disk, so the layout
change, the LR policy and the data position are handled the way a restart
handles them (:mod:`hybrid.app.state.membership`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["HeldState", "Progress", "checkpoint_meta"]


@dataclass
class Progress:
    """The last step this rank's model, optimizer and schedule have completed, and the data position after it.
    A step counts once its optimizer and schedule step are done; batches a failed step drew are not in
    ``data``."""

    step: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    step_s: float = 0.0  # how long the last step took (recovery in place sizes its lead in steps by it)


def checkpoint_meta(model_config: dict[str, Any], world_size: int, nnodes: int, global_batch: int,
                    state_kind: str) -> dict[str, Any]:
    """What a checkpoint says besides the state itself: the model it holds and the layout that wrote it."""
    return {"model_config": model_config, "world_size": world_size, "nnodes": nnodes, "global_batch": global_batch,
            "state_dict_kind": state_kind}


@dataclass
class HeldState:
    """One worker's state as a checkpoint holds it (model, optimizer, schedule, step, data, RNG, membership and
    layout), taken from memory; ``why`` is the membership history's entry for the change."""

    state: dict[str, Any] | None
    source: int  # the rank of the new group whose state everyone continues from
    why: str

    def share(self) -> dict[str, Any]:
        """The source's state, on every rank of the new default group. Collective."""
        box = [self.state if dist.get_rank() == self.source else None]
        dist.broadcast_object_list(box, src=self.source)
        return box[0]
