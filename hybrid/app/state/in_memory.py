"""A run's state held in memory, for recovery in place (``cluster.recovery=in_place``).

When a collective fails because a peer died, the surviving workers keep their
processes and their state. What they continue from is the last step each one
completed (:class:`Progress`, kept up to date by the training loop): a failure
inside a step leaves the model, optimizer and schedule as they were after the
step before (the gradients are thrown away), a failure after a step's update
leaves them after it (DiLoCo: after the inner step, with what its outer step had
left to do). The survivors agree on who is in; each then continues from its own
:class:`HeldState`, or from a live peer's copy of what it lacks as of the most
advanced worker's step (:mod:`hybrid.app.state.peer_state`), loaded exactly as a
checkpoint would be from disk, so the layout change, the LR policy and the data
position are handled the way a restart handles them (:mod:`hybrid.app.state.membership`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hybrid.app.state.peer_state import Offer, assemble

__all__ = ["HELD_OUTER_KEY", "HeldState", "Progress", "checkpoint_meta"]


@dataclass
class Progress:
    """The last step this rank's model, optimizer and schedule have completed, and the data position after it.
    A step counts once its optimizer and schedule step are done; batches a failed step drew are not in
    ``data``."""

    step: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    step_s: float = 0.0  # how long the last step took (recovery in place sizes its lead in steps by it)
    # The updates a node-sharded optimizer's shard had taken then: one more now means the shard is a step ahead.
    optimizer_updates: int = 0


def checkpoint_meta(model_config: dict[str, Any], world_size: int, nnodes: int, global_batch: int,
                    state_kind: str, no_decay: bool = False) -> dict[str, Any]:
    """What a checkpoint says besides the state itself: the model it holds, the layout that wrote it, and how its
    optimizer's param groups are made (``optim.no_decay``: a resume must make them the same way)."""
    return {"model_config": model_config, "world_size": world_size, "nnodes": nnodes, "global_batch": global_batch,
            "state_dict_kind": state_kind, "optim_no_decay": no_decay}


# The entry of a state continued in place that holds DiLoCo's outer state: {"shared": ..., "node": ...} (this rank's
# share and its node's exchanges in flight, :meth:`hybrid.core.diloco.OuterSync.held_state`).
HELD_OUTER_KEY = "diloco_held"


@dataclass
class HeldState:
    """This worker's state held in memory, by part (:mod:`hybrid.app.state.peer_state`): what it offers the new
    group (no kind: a worker of a node that joins) and the parts' values; ``why``: the membership history's entry
    for the change."""

    offer: Offer
    parts: dict[str, Any]
    why: str

    def assemble(self, log: Callable[[str], None]) -> dict[str, Any]:
        """This worker's state as a checkpoint would hold it, each part its own or a live peer's as of the most
        advanced worker's version. Collective over the new default group. Afterwards this worker holds it (a
        failure before the run continues offers it again)."""
        self.offer, self.parts = assemble(self.offer, self.parts, log)
        values = self.parts
        state = {**values["run"], "model": values["model"], "optimizer": values["optimizer"],
                 # None: no DiLoCo phase built yet (comm=adaptive had just entered one): it starts from the weights
                 HELD_OUTER_KEY: {"shared": values["outer"], "node": values["node_outer"]} if "outer" in values else None}
        return state
