"""Byte formulas and the counter object, without processes."""

import threading

import pytest

from hybrid.core.comm.counters import PHASES, PhaseCounters, allreduce_bytes, rooted_bytes

pytestmark = pytest.mark.unit


def test_ring_byte_formulas():
    assert allreduce_bytes(1000, 1) == 0
    assert allreduce_bytes(1000, 2) == 1000
    assert allreduce_bytes(1000, 4) == 1500
    assert allreduce_bytes(800, 8) == 1400
    assert rooted_bytes(1000, 1) == 0
    assert rooted_bytes(1000, 4) == 750


def test_hierarchical_sends_fewer_bytes_across_nodes_than_flat():
    # 2 nodes x 4: a node-by-node flat ring pushes 2(N-1)/N S through each NIC,
    # the leaders' ring 2(n-1)/n S (1.75 S vs 1.0 S).
    size = 25 * 2**20
    assert allreduce_bytes(size, 8) / allreduce_bytes(size, 2) == pytest.approx(1.75)


def test_counters_accumulate_snapshot_and_reset():
    c = PhaseCounters()
    c.add("intra_reduce", 0.5, 100)
    c.add("intra_reduce", 0.25, 50)
    snap = c.snapshot(reset=True)
    assert set(snap) == set(PHASES)
    assert snap["intra_reduce"].seconds == 0.75 and snap["intra_reduce"].bytes == 150
    assert snap["intra_reduce"].calls == 2
    assert all(s.calls == 0 for s in c.snapshot().values())
    with pytest.raises(KeyError, match="bogus"):
        c.add("bogus", 1.0, 1)


def test_counters_are_safe_across_threads():
    c = PhaseCounters()

    def work():
        for _ in range(1000):
            c.add("inter_allreduce", 0.001, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert c.snapshot()["inter_allreduce"].bytes == 4000
