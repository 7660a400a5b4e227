"""The control plane on etcd (``cluster.rdzv_backend=etcd``): a real 3-member cluster of Debian's etcd-server.

The store the workers agree on (torch's EtcdStore with etcd's compare-and-swap) keeps working when the member its
client talks to is SIGKILLed; and the elastic and in-place tests of tests/test_elastic.py pass on etcd as they
do on the c10d store, the in-place one with an etcd member SIGKILLed mid-run before the node is. The etcd tier:
``pytest --etcd -m etcd`` (``.ci/etcd-tier`` installs etcd-server and python-etcd first)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest

from helpers.elastic_scenarios import a_node_killed_in_place, a_node_killed_restart

pytestmark = pytest.mark.etcd
ON_ETCD = ("cluster.rdzv_backend=etcd",)


def _leader(cluster) -> int:
    """The index of the cluster's leader (etcd's own /v2/stats/self)."""
    import json
    import urllib.request

    for i, m in enumerate(cluster.members):
        with urllib.request.urlopen(f"http://{cluster.host}:{m.client_port}/v2/stats/self", timeout=5) as answer:
            if json.loads(answer.read())["state"] == "StateLeader":
                return i
    raise AssertionError("no leader")


def test_the_quorums_store_keeps_its_answers_when_the_leader_it_talks_to_is_killed():
    """compare_set as c10d's (the first writer's value stands; a later writer reads it back), add, check and
    wait, before and after the member the clients started from, the cluster's leader, is SIGKILLed (the clients
    move to another member and ride out the election); stop() leaves no member running."""
    from hybrid.runtime.etcd_cluster import start_etcd
    from hybrid.runtime.etcd_store import ETCD_SCHEME, connect_store

    cluster = start_etcd("127.0.0.1")
    try:
        leader = _leader(cluster)
        members = cluster.endpoint.split(",")
        endpoint = ETCD_SCHEME + ",".join([members[leader]] + members[:leader] + members[leader + 1:])
        first, second = (connect_store(endpoint, timedelta(seconds=10)) for _ in range(2))
        assert first.compare_set("decision", "", b"mine") == b"mine"
        assert second.compare_set("decision", "", b"theirs") == b"mine"
        assert first.add("beats", 2) == 2 and second.add("beats", 3) == 5
        os.kill(cluster.pids()[leader], signal.SIGKILL)  # the leader: where both clients started
        assert second.add("beats", 1) == 6 and first.add("beats", 0) == 6
        assert first.compare_set("epoch1", "", b"a") == b"a" and second.compare_set("epoch1", "", b"b") == b"a"
        assert second.check(["decision", "epoch1"]) and not second.check(["never"])
        first.set("late", b"x")
        second.wait(["late"], timedelta(seconds=5))
        assert second.get("late") == b"x"
    finally:
        pids = cluster.pids()
        cluster.stop()
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in pids)


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_one_member(pids: list[int]) -> None:
    """SIGKILL one of the job's etcd members (a child of the launcher, named etcd)."""
    members = [p for p in pids if _name(p) == "etcd"]
    assert len(members) == 3, members
    os.kill(members[1], signal.SIGKILL)
    print(f"etcd member {members[1]} SIGKILLed at {time.strftime('%X')}")


def _name(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


@pytest.mark.background
def test_in_place_on_etcd_loses_a_member_then_a_node_and_finishes(tmp_path):
    """3x1 hierarchical in place on etcd: one member SIGKILLed after step 5, node 2 after step 11; the others keep
    their processes, finish every step with identical replicas, and nothing is left (members, agents, workers)."""
    a_node_killed_in_place(1, "hierarchical", 2, tmp_path, ON_ETCD, mid_run=_kill_one_member)


@pytest.mark.background
def test_a_node_killed_on_etcd_restarts_the_others_from_the_checkpoint(tmp_path):
    a_node_killed_restart(2, "sharded", 0, tmp_path, ON_ETCD)


# On the testbed (the etcd members in its service namespace), each node at a tenth of a CPU: a step takes longer and
# costs the machine less, so the returning node joins within fewer steps (cluster.testbed.cpu_quota).
@pytest.mark.background
def test_a_lost_node_rejoins_in_place_on_etcd(tmp_path):
    """3x1 hierarchical in place on etcd: node 0 (rank 0's) SIGKILLed after step 11 and its agent started again; the
    others keep their processes, the returned node gets its state from a live peer, and the run ends on 3 nodes."""
    a_node_killed_in_place(1, "hierarchical", 0, tmp_path, ON_ETCD, steps=80, back=True, cpus=0.1)
