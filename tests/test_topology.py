"""The layout arithmetic and validation, without processes."""

import pytest

from hybrid.core.topology import Layout, RankInfo, WorkerEnv, build_topology

pytestmark = pytest.mark.unit


def infos_for(node_sizes, order=None):
    infos, rank = [], 0
    for node, size in enumerate(node_sizes):
        for local in range(size):
            infos.append(RankInfo(rank, node, local, size))
            rank += 1
    return infos


@pytest.mark.parametrize(
    "text,sizes", [("2x4", (4, 4)), ("1x1", (1,)), ("3,1", (3, 1)), ("2,1,1", (2, 1, 1)), (" 4X2 ", (2, 2, 2, 2))]
)
def test_layout_parse(text, sizes):
    assert Layout.parse(text).node_sizes == sizes


@pytest.mark.parametrize("text", ["", "2x", "x2", "2x0", "0x2", "2,0", "a,b", "2x2x2", "-1,2"])
def test_layout_parse_rejects_with_the_value(text):
    with pytest.raises(ValueError) as err:
        Layout.parse(text)
    assert repr(text) in str(err.value) or "at least 1" in str(err.value) or ">= 1" in str(err.value)


def test_uniform_topology_roles():
    topo = build_topology(5, infos_for((4, 4)))
    assert topo.nnodes == 2 and topo.world_size == 8
    assert topo.node == 1 and topo.local_rank == 1 and topo.local_world_size == 4
    assert topo.leaders == (0, 4) and topo.leader == 4 and not topo.is_leader
    assert topo.node_ranks == (4, 5, 6, 7)
    assert topo.cross_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_uneven_topology_and_no_cross_groups():
    topo = build_topology(3, infos_for((3, 1)))
    assert topo.node_sizes == (3, 1) and not topo.is_uniform
    assert topo.is_leader and topo.leaders == (0, 3)
    with pytest.raises(ValueError, match=r"\[3, 1\]"):
        topo.cross_groups()


def test_node_ids_need_not_be_contiguous_or_ordered():
    # Ranks of one node interleaved with another, and arbitrary node ids.
    infos = [RankInfo(0, 7, 0, 2), RankInfo(1, 3, 0, 2), RankInfo(2, 7, 1, 2), RankInfo(3, 3, 1, 2)]
    topo = build_topology(2, infos)
    assert topo.nodes == ((1, 3), (0, 2))
    assert topo.node == 1 and topo.local_rank == 1 and topo.leader == 0


def test_world_of_4_declared_as_3_nodes_of_2_names_both_numbers():
    with pytest.raises(ValueError) as err:
        build_topology(0, infos_for((2, 2)), expected=Layout.uniform(3, 2))
    assert str(err.value) == "nnodes (3) x nproc_per_node (2) = 6 != WORLD_SIZE (4)"


def test_declared_uneven_layout_must_match_launched_one():
    with pytest.raises(ValueError, match=r"node sizes \[2, 2\].*node sizes \[3, 1\]"):
        build_topology(0, infos_for((3, 1)), expected=Layout((2, 2)))


def test_duplicate_local_rank_is_rejected():
    infos = [RankInfo(0, 0, 0, 2), RankInfo(1, 0, 0, 2)]
    with pytest.raises(ValueError, match=r"local ranks \[0, 0\]"):
        build_topology(0, infos)


def test_local_world_size_disagreeing_with_node_is_rejected():
    infos = [RankInfo(0, 0, 0, 3), RankInfo(1, 0, 1, 3)]
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 but node 0 has 2"):
        build_topology(0, infos)


def test_missing_ranks_are_rejected():
    with pytest.raises(ValueError, match=r"ranks \[0, 2\]"):
        build_topology(0, [RankInfo(0, 0, 0, 1), RankInfo(2, 1, 0, 1)])


def test_worker_env_reads_torchrun_variables():
    env = WorkerEnv.from_env(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    )
    assert env.info() == RankInfo(5, 1, 1, 4) and env.world_size == 8


def test_worker_env_names_what_is_missing_or_bad():
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE, GROUP_RANK not set"):
        WorkerEnv.from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    with pytest.raises(RuntimeError, match="RANK='x'"):
        WorkerEnv.from_env(
            {"RANK": "x", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
        )
