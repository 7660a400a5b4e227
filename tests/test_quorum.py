"""The survivors' agreement on the next membership (hybrid.runtime.quorum), on a real TCPStore, with each worker
a thread that checks in (or does not) the way a worker process would: who is in, who is gone, one decision."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from hybrid.runtime.quorum import LeftOut, Member, Membership, Quorum

pytestmark = pytest.mark.unit

THREE_BY_TWO = Membership(0, tuple(Member(n, r) for n in range(3) for r in range(2)))


@pytest.fixture
def store():
    from hybrid.runtime.launch import free_port as port_of

    port = port_of()
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def agree_all(store, prefix, current, reporting, beating, dead_after_s=0.3, timeout_s=5.0):
    """Run ``agree`` for each worker of ``reporting`` (member -> step) in threads; ``beating``: workers whose
    heartbeat runs but who never check in (alive, stuck). Returns each reporter's membership or exception."""
    quorum = Quorum(store, prefix, dead_after_s, timeout_s)
    clients = {}
    hearts = []
    for m in [*reporting, *beating]:
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        hearts.append(quorum.heartbeat(m, client))
    results = {}

    def run(m, step):
        own = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        clients[m] = own
        try:
            results[m] = Quorum(own, prefix, dead_after_s, timeout_s).agree(current, Member(m.node, m.local_rank, step))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[m] = exc

    threads = [threading.Thread(target=run, args=(m, step)) for m, step in reporting.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    for h in hearts:
        h.stop()
    return results


def test_a_dead_node_is_left_out_and_every_survivor_reads_one_decision(store):
    """Node 2's workers neither beat nor check in: after the dead time they are out; the survivors, each
    with its own last step, read the same membership, ranked by node then local rank, and the source is
    the lowest rank of those that completed the most steps."""
    steps = {Member(0, 0): 11, Member(0, 1): 11, Member(1, 0): 12, Member(1, 1): 12}
    results = agree_all(store, "t1", THREE_BY_TWO, steps, beating=[])
    assert len(results) == 4 and all(isinstance(r, Membership) for r in results.values()), results
    assert len(set(results.values())) == 1  # one decision, the same everywhere
    new = results[Member(0, 0)]
    assert new.epoch == 1 and new.nodes == (0, 1)
    assert [(m.node, m.local_rank, m.step) for m in new.members] == [(0, 0, 11), (0, 1, 11), (1, 0, 12), (1, 1, 12)]
    assert new.source() == 2
    env = new.env_of(1, 1)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node) == (3, 4, 1, 2, 1)


def test_a_node_that_lost_one_worker_is_out_whole_and_its_survivor_is_told(store):
    """Worker 1.1 is gone, worker 1.0 checks in: membership is by whole node, so 1.0 is left out (it
    raises LeftOut, naming itself); nodes 0 and 2 go on."""
    steps = {Member(0, 0): 5, Member(0, 1): 5, Member(1, 0): 5, Member(2, 0): 5, Member(2, 1): 5}
    results = agree_all(store, "t2", THREE_BY_TWO, steps, beating=[])
    assert isinstance(results[Member(1, 0)], LeftOut) and "worker 1.0" in str(results[Member(1, 0)])
    assert results[Member(0, 0)].nodes == (0, 2)


def test_a_live_worker_is_waited_for_until_it_checks_in_or_its_time_is_up(store):
    """Worker 2.0 beats but never checks in (alive, blocked): the others wait for it rather than decide
    without it, until the agreement's timeout takes it as stuck; its node is then out."""
    import time

    steps = {Member(0, 0): 3, Member(0, 1): 3, Member(1, 0): 3, Member(1, 1): 3, Member(2, 1): 3}
    start = time.monotonic()
    results = agree_all(store, "t3", THREE_BY_TWO, steps, beating=[Member(2, 0)], timeout_s=2.0)
    waited = time.monotonic() - start
    assert waited >= 2  # the timeout, not the 0.3 s dead time: a beating worker is never taken as dead
    assert results[Member(0, 0)].nodes == (0, 1)
    assert isinstance(results[Member(2, 1)], LeftOut)


def test_a_worker_that_checked_in_is_in_though_its_heartbeat_then_stands_still(store):
    """Node 2's workers check in as soon as their collective fails and then beat no more (a recovery that holds
    the GIL on a busy machine): they are in, with their steps, not taken as gone after the dead time."""
    quorum = Quorum(store, "t5", 0.3, 5.0)
    for local in (0, 1):
        quorum.check_in(THREE_BY_TWO, Member(2, local, 7))
    steps = {Member(n, r): 7 for n in (0, 1) for r in (0, 1)}
    results = agree_all(store, "t5", THREE_BY_TWO, steps, beating=[])
    assert len(set(results.values())) == 1, results
    new = results[Member(0, 0)]
    assert new.nodes == (0, 1, 2) and [(m.node, m.step) for m in new.members][-2:] == [(2, 7), (2, 7)]


def test_a_running_workers_heartbeat_is_told_once_when_a_peer_checks_in_for_the_next_epoch(store):
    """A DiLoCo node between its syncs has no collective to fail: its heartbeat must tell it that another worker
    checked in after a failure, once per epoch, and not before anyone has."""
    import time

    quorum = Quorum(store, "t6", 0.3, 5.0)
    told = threading.Event()
    count = []
    epoch = [0]

    def on_recovery():
        count.append(epoch[0])
        told.set()

    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    heart = quorum.heartbeat(Member(0, 0), client, epoch=lambda: epoch[0], on_recovery=on_recovery)
    try:
        assert not told.wait(0.5)  # nobody has checked in: nothing said
        quorum.check_in(THREE_BY_TWO, Member(2, 1, 11))
        quorum.check_in(THREE_BY_TWO, Member(2, 0, 11))
        assert told.wait(5.0)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # more beats, more check-ins of the same epoch: told only once
            time.sleep(0.05)
        assert count == [0]
    finally:
        heart.stop()
