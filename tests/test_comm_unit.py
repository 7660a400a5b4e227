"""Single-process parts of the communicators: the averaging division, which groups each one needs."""

import re
from datetime import timedelta

import pytest
import torch

from hybrid.core.comm import ALGORITHM_CLASSES, CommGroups, group_kinds_for, make_communicator
from hybrid.core.comm.base import SUPPORTED_DTYPES, Communicator
from hybrid.core.topology import Topology

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 6, 8, 64, 1024])
def test_divide_matches_div_bit_for_bit(dtype, divisor):
    gen = torch.Generator().manual_seed(divisor)
    info = torch.finfo(dtype)
    values = torch.cat([
        torch.randn(4096, generator=gen, dtype=torch.float64) * 1e3,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, 7.0]),
        # the tiny end, where a result is subnormal and must be rounded the same way
        torch.tensor([info.tiny, -info.tiny, info.tiny * 3, info.tiny / 2, info.max, -info.max]),
        torch.tensor([float("inf"), float("-inf"), float("nan")]),
    ]).to(dtype)
    expected = values.clone().div_(divisor)
    got = Communicator._divide_(values.clone(), divisor)
    # Compare the raw bits: torch.equal treats NaN as unequal and -0.0 as 0.0.
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    assert torch.equal(got.view(as_int), expected.view(as_int))


def test_divide_works_in_place():
    t = torch.full((5,), 8.0)
    assert Communicator._divide_(t, 4) is t
    assert torch.equal(t, torch.full((5,), 2.0))


def _groups(topology, kinds):
    """A CommGroups that built ``kinds`` (no process group is needed to check what is missing)."""
    return CommGroups(topology, "gloo", "gloo", timedelta(seconds=1), world=None, intra=None,
                      leaders=None, cross=None, kinds=frozenset(kinds))


def test_each_algorithm_needs_only_its_groups():
    even, uneven = Topology(0, ((0, 1), (2, 3))), Topology(0, ((0, 1, 2), (3,)))
    assert group_kinds_for("flat", even) == ("world",)
    assert group_kinds_for("hierarchical", even) == ("intra", "leaders")
    assert group_kinds_for("sharded", even) == ("intra", "cross")
    assert group_kinds_for("sharded", uneven) == ("intra", "leaders")  # it falls back to hierarchical
    with pytest.raises(ValueError, match="'ring'"):
        group_kinds_for("ring", even)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_CLASSES))
def test_a_communicator_over_groups_it_does_not_have_names_them(algorithm):
    topo = Topology(0, ((0, 1), (2, 3)))
    others = {"flat": ["intra", "leaders", "cross"], "hierarchical": ["world"], "sharded": ["world", "leaders"]}
    with pytest.raises(ValueError, match=rf"{algorithm} talks over the groups .* were not built"):
        make_communicator(algorithm, _groups(topo, others[algorithm]))


def test_group_kinds_outside_the_known_ones_are_refused():
    with pytest.raises(ValueError, match=r"\['rings'\] are not among world, intra, leaders, cross"):
        CommGroups.build(Topology(0, ((0,),)), kinds=["world", "rings"])


def test_flat_falls_back_to_sum_and_divides_where_the_transport_cannot_average(monkeypatch):
    """A torch whose gloo refuses ReduceOp.AVG: flat sums and divides itself, from then on."""
    import torch.distributed as dist

    from hybrid.core.comm import FlatCommunicator

    calls = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(op)
        if op == dist.ReduceOp.AVG:
            raise ValueError("Cannot use ReduceOp.AVG with Gloo")
        tensor.mul_(4)  # what a SUM over 4 ranks holding the same tensor returns

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    topo = Topology(0, ((0, 1), (2, 3)))
    comm = FlatCommunicator(_groups(topo, ["world"]))
    assert comm.transport_avg  # gloo: averaging in the transport is tried first
    x = torch.arange(6, dtype=torch.float32)
    assert torch.equal(comm.all_reduce_mean_(x.clone()), x)
    assert not comm.transport_avg and calls == [dist.ReduceOp.AVG, dist.ReduceOp.SUM]
    assert torch.equal(comm.all_reduce_mean_(x.clone()), x)
    assert calls[2:] == [dist.ReduceOp.SUM]  # no second try


def test_flat_lets_other_all_reduce_errors_through(monkeypatch):
    import torch.distributed as dist

    from hybrid.core.comm import CommError, FlatCommunicator

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    comm = FlatCommunicator(_groups(Topology(0, ((0, 1), (2, 3))), ["world"]))
    with pytest.raises(CommError, match="flat flat_allreduce failed on rank 0 .*Connection closed by peer"):
        comm.all_reduce_mean_(torch.ones(3))
    assert comm.transport_avg



class _Done:
    """A finished Work."""

    def wait(self) -> bool:
        return True


def _fake_sharded_transport(monkeypatch):
    """dist as rank 0 of a 2x2 job sees it when all four ranks hold the same tensor; records the calls."""
    import torch.distributed as dist

    calls = []

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        calls.append(("all_to_all_single", list(input_split_sizes), list(output_split_sizes)))
        mine = input[:input_split_sizes[0]]  # what each of the node's 2 ranks sends local rank 0
        output.copy_(torch.cat([mine, mine]))
        return _Done()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", tensor.numel()))
        tensor.mul_(2)  # over the 2 nodes
        return _Done()

    def broadcast(tensor, src, group=None, async_op=False):
        calls.append(("broadcast", src, tensor.numel()))
        return _Done()

    for name, fn in [("all_to_all_single", all_to_all_single), ("all_reduce", all_reduce),
                     ("broadcast", broadcast)]:
        monkeypatch.setattr(dist, name, fn)
    topo = Topology(0, ((0, 1), (2, 3)))
    groups = CommGroups(topo, "gloo", "gloo", timedelta(seconds=1), world=None, intra=object(),
                        leaders=None, cross=object(), kinds=frozenset(["intra", "cross"]))
    return make_communicator("sharded", groups), calls


@pytest.mark.parametrize("numel, splits", [(8, [4, 4]), (7, [4, 3]), (1, [1, 0])])
def test_sharded_reduce_scatters_with_one_all_to_all_and_a_local_sum(monkeypatch, numel, splits):
    """Each worker sends shard j to local rank j in one all_to_all (unequal shards as unequal splits),
    sums the copies of its own shard, all-reduces it across nodes, and broadcasts it in the node."""
    comm, calls = _fake_sharded_transport(monkeypatch)
    x = torch.arange(numel, dtype=torch.float32)
    assert torch.equal(comm.all_reduce_mean_(x.clone()), x)
    assert calls == [("all_to_all_single", splits, [splits[0]] * 2), ("all_reduce", splits[0]),
                     *[("broadcast", j, n) for j, n in enumerate(splits) if n]]


def test_sharded_pipelines_pieces_through_two_reused_inboxes(monkeypatch):
    comm, calls = _fake_sharded_transport(monkeypatch)
    comm.chunk_bytes = 4 * 4  # pieces of 4 floats: 5 pieces of a 20-element tensor
    x = torch.arange(20, dtype=torch.float32)
    assert torch.equal(comm.all_reduce_mean_(x.clone()), x)
    assert [c[0] for c in calls].count("all_to_all_single") == 5


def test_gloo_groups_made_for_cross_group_j_start_on_nic_j_mod_k(monkeypatch):
    """Sharded's cross groups run side by side; gloo takes a group's NICs in turn from the first one named, so
    cross group j is made with the list rotated by j: groups 0..K-1 start on K different NICs."""
    import os

    from hybrid.core.comm.groups import gloo_nics_starting_at

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nic0,nic1,nic2")
    seen = []
    for j in range(4):
        with gloo_nics_starting_at(j):
            seen.append(os.environ["GLOO_SOCKET_IFNAME"])
    assert seen == ["nic0,nic1,nic2", "nic1,nic2,nic0", "nic2,nic0,nic1", "nic0,nic1,nic2"]
    assert os.environ["GLOO_SOCKET_IFNAME"] == "nic0,nic1,nic2"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # one NIC: nothing to rotate
    with gloo_nics_starting_at(1):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0"


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, "sync_every=0 must be an integer >= 1"),
    ({"sync_every": 2.5}, "sync_every=2.5 must be an integer >= 1"),
    ({"sync_every": 8, "inter": "flat"}, "inter='flat' is not one of hierarchical, sharded"),
    ({"sync_every": 8, "fragments": 3}, "fragments=3 must be an integer in 1..3 (the parameter tensors) that divides "
                                        "sync_every=8"),
    ({"sync_every": 8, "fragments": 4}, "fragments=4 must be an integer in 1..3"),
    ({"sync_every": 8, "fragments": 2, "overlap": True, "overlap_steps": 5},
     "overlap_steps=5 must be an integer in 1..4 (sync_every / fragments"),
    ({"sync_every": 8, "overlap": True, "overlap_steps": 0}, "overlap_steps=0 must be an integer in 1..8"),
])
def test_diloco_outer_sync_refuses_bad_settings_in_one_line(kwargs, message):
    from hybrid.core.diloco import OuterSync

    with pytest.raises(ValueError, match=re.escape(message)):
        OuterSync([torch.zeros(3)] * 3, None, **kwargs)  # refused before the groups are looked at
