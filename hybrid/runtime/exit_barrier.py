"""Count a lost node's agent in at torch's exit barrier, so that the survivors' torchrun agents need not wait for it.

When its workers finish, each torch elastic agent waits at an exit barrier for
every agent of its rendezvous round (torch's ``_exit_barrier``: an ``add`` to a
counter in the round's store, then a wait for the last one to arrive; 300 s at
most, which torchrun does not let you change). After recovery in place, the
agent of a node lost on the way is still a member of that round (in place, no
agent rendezvoused again) and never arrives: the survivors' agents wait the
whole 300 s before they exit. hybrid's own agent counts only the nodes that
finished (:mod:`hybrid.runtime.agent`); under plain torchrun the finishing
workers count the lost agents in themselves: they read the round and its
participants through torch's own rendezvous backend (c10d or etcd-v2, the store
the agents share with them), and add the missing arrivals to that barrier as
torch's agents add theirs.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["count_in_lost_agents"]


def _rendezvous_state(store: Any, run_id: str) -> Any:
    """torch's dynamic-rendezvous state of ``run_id`` (round, participants), read through its backend for
    ``store`` (an ``EtcdStore``, or a c10d store); None where there is none."""
    if hasattr(store, "client"):  # torch's EtcdStore: the etcd-v2 backend's state, under its own prefix
        from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

        backend = EtcdRendezvousBackend(store.client, run_id, key_prefix="/torch/elastic/rendezvous")
    else:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        backend = C10dRendezvousBackend(store, run_id)
    found = backend.get_state()
    return None if found is None else pickle.loads(found[0])


def count_in_lost_agents(store: Any, run_id: str, finished_nodes: int) -> int:
    """Add the agents of the current round that will never reach torch's exit barrier (those of nodes lost
    on the way: the round's participants beyond the ``finished_nodes``) to its count, completing it where
    theirs is the last arrival. Returns how many were counted in (0: none missing, or no round to read)."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS

    state = _rendezvous_state(store, run_id)
    if state is None:
        return 0
    members = len(state.participants)
    missing = members - finished_nodes
    if missing <= 0:
        return 0
    # The round's store, as torch's dynamic rendezvous hands it to its agents.
    round_store = dist.PrefixStore(f"torch.rendezvous.{run_id}.{state.round}", store)
    arrived = round_store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, missing)
    if arrived == members:  # the last arrival sets the flag every agent waits for, as torch's barrier does
        round_store.set(_TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN, "<val_ignored>")
    return missing
