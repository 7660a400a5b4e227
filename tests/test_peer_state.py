"""After a membership change in place: who sends which part of the state to whom (hybrid.app.state.peer_state), and
DiLoCo's outer step interrupted between its operations and resumed from what it held (hybrid.core.diloco)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from hybrid.app.state.peer_state import Offer, describe_transfers, plan_transfers
from hybrid.core.diloco import OuterSync
from hybrid.core.topology import Topology

pytestmark = pytest.mark.unit

AT = (12, 0)


def offers(kind: str, nodes: int, per_node: int, versions: dict[int, dict[str, tuple[int, ...]] | None] = None,
           ) -> list[Offer]:
    """rank r = node * per_node + j, every part at AT unless ``versions[r]`` says otherwise (None: a joiner)."""
    parts = ("run", "model", "optimizer", *(("outer", "node_outer") if kind.startswith("diloco") else ()))
    out = []
    for r in range(nodes * per_node):
        given = (versions or {}).get(r, {})
        held = None if given is None else {name: given.get(name, AT) for name in parts}
        out.append(Offer(kind if held is not None else None, r // per_node, r % per_node, held or {}))
    return out


def test_survivors_at_the_same_step_keep_their_own_state_and_nothing_moves():
    assert plan_transfers(offers("replicated", 2, 2)) == (0, [])


def test_a_survivor_a_step_behind_and_a_joiner_get_every_part_from_the_lowest_rank_at_the_step():
    behind = {name: (11, 0) for name in ("run", "model", "optimizer")}
    source, moved = plan_transfers(offers("replicated", 3, 2, {0: behind, 4: None, 5: None}))
    assert source == 1 and moved == [(name, 1, r) for name in ("model", "optimizer", "run") for r in (0, 4, 5)]


def test_a_returning_nodes_workers_get_their_shards_from_the_same_local_rank_on_a_live_node():
    _, moved = plan_transfers(offers("node_sharded", 3, 2, {4: None, 5: None}))
    assert ("optimizer", 0, 4) in moved and ("optimizer", 1, 5) in moved
    assert ("model", 0, 5) in moved and len(moved) == 6


def test_under_hsdp_a_returning_nodes_workers_get_model_and_optimizer_shards_from_their_local_rank_only():
    # comm=hsdp: FSDP2 shards the parameters as well as their optimizer state over a node's workers.
    _, moved = plan_transfers(offers("sharded_model", 3, 2, {0: None, 1: None}))
    assert sorted(moved) == sorted([(part, 2 + j, j) for part in ("model", "optimizer") for j in (0, 1)]
                                   + [("run", 2, 0), ("run", 2, 1)])
    with pytest.raises(RuntimeError, match="no live worker holds the model of local/1"):
        plan_transfers(offers("sharded_model", 2, 2, {1: {"model": (11, 0)}, 3: None}))


def test_a_shard_a_step_ahead_is_replaced_by_a_peers_at_the_step_and_a_lost_only_copy_is_refused():
    # Rank 1's shard took its update of step 13 but the node's gather did not finish: it takes rank 3's.
    assert plan_transfers(offers("node_sharded", 2, 2, {1: {"optimizer": (13, 0)}})) == (0, [("optimizer", 3, 1)])
    # No live worker of local rank 1 holds its shard as of step 12: recovery in place cannot continue exactly.
    with pytest.raises(RuntimeError, match="no live worker holds the optimizer of local/1 as of step 12"):
        plan_transfers(offers("node_sharded", 2, 2, {1: {"optimizer": (13, 0)}, 3: {"optimizer": (13, 0)}}))


def test_diloco_nodes_at_one_step_keep_their_own_weights_and_a_node_behind_takes_the_source_nodes_whole():
    redo = {name: (13, -1) for name in ("run", "model", "optimizer", "outer", "node_outer")}
    assert plan_transfers(offers("diloco_sharded", 2, 2, {r: redo for r in range(4)})) == (0, [])  # all redo it
    # Node 1 missed the landing node 0 completed: all of node 0's parts, each worker's share from its local rank.
    landed = {name: (13, 0) for name in redo}
    _, moved = plan_transfers(offers("diloco_sharded", 2, 2, {0: landed, 1: landed, 2: redo, 3: redo}))
    assert {(name, s, r) for name, s, r in moved if name in ("model", "optimizer", "node_outer", "run")} == {
        (name, 0, r) for name in ("model", "optimizer", "node_outer", "run") for r in (2, 3)}
    assert ("outer", 0, 2) in moved and ("outer", 1, 3) in moved


def test_diloco_with_a_sharded_inner_optimizer_a_returning_node_takes_one_nodes_weights_and_its_shards_by_local_rank():
    # comm=diloco with comm.shard_optimizer: node 2 returns; nodes 0 and 1 hold different weights and inner shards.
    _, moved = plan_transfers(offers("diloco+zero", 3, 2, {4: None, 5: None}))
    assert {(name, s, r) for name, s, r in moved if name != "optimizer"} == {
        (name, 0, r) for name in ("model", "node_outer", "run", "outer") for r in (4, 5)}
    assert sorted(m for m in moved if m[0] == "optimizer") == [("optimizer", 0, 4), ("optimizer", 1, 5)]
    # A survivor's own shard is its own: another node's worker of the same local rank holds different numbers.
    assert plan_transfers(offers("diloco_sharded+zero", 2, 2)) == (0, [])


def test_ranks_on_either_side_of_a_switch_all_continue_in_the_kind_of_the_one_furthest_along():
    # comm=adaptive: ranks 0-1 committed the switch out of DiLoCo (2 switches), ranks 2-3 did not (1 switch).
    after = offers("replicated", 1, 2, {r: {n: (20, 2, 0) for n in ("run", "model", "optimizer")} for r in (0, 1)})
    before = offers("diloco", 2, 2, {r: {n: (20, 1, 0) for n in ("run", "model", "optimizer", "outer", "node_outer")}
                                     for r in (2, 3)})[2:]
    source, moved = plan_transfers(after + before)
    assert source == 0 and {name for name, _, _ in moved} == {"run", "model", "optimizer"}  # no DiLoCo part left
    assert {(s, r) for _, s, r in moved} == {(0, 2), (0, 3)}


def test_the_transfer_line_says_who_received_what_and_how_many_bytes():
    line = describe_transfers([[], [("model", 0, 2048), ("optimizer", 0, 4096)]], 0, 12)
    assert line == ("in place: state as of step 12 (most advanced: rank 0); rank 1 <- model 2 KiB from rank 0, "
                    "optimizer 4 KiB from rank 0 (6144 bytes)")
    assert describe_transfers([[], []], 1, 7).endswith("every rank kept its own, 0 bytes moved")


# DiLoCo's outer step as a plan of transactions, on one node (no exchange to wait for): interrupted between two
# operations, the held state continues on a fresh OuterSync to the same bits as the run that was not interrupted.

def _outer(model: torch.nn.Module, **kwargs) -> OuterSync:
    groups = types.SimpleNamespace(topology=Topology(0, ((0,),)), intra=object(), leaders=object(), cross=None)
    return OuterSync(model.parameters(), groups, sync_every=4, fragments=2, transactional=True, **kwargs)


def _inner_step(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=torch.float32).view_as(p) + step + k) * 0.01)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_outer_step_interrupted_after_its_first_operation_resumes_to_the_same_bits(overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    kwargs = {"overlap": overlap, "overlap_steps": 1}
    straight, broken = copy.deepcopy(model), copy.deepcopy(model)
    a, b = _outer(straight, **kwargs), _outer(broken, **kwargs)
    last = 8  # fragments sync at 2, 4, 6, 8; the last step also lands what is in flight and syncs what moved
    for step in range(1, last + 1):
        _inner_step(straight, step)
        a.step(step, final=step == last)
    for step in range(1, last):
        _inner_step(broken, step)
        b.step(step)
    _inner_step(broken, last)
    calls = {"n": 0}

    def fails_second(real):  # the last step's second landing or sync fails, as an exchange with a lost node would
        def op(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("Connection closed by peer")
            return real(*args, **kwargs)
        return op
    b._sync_now, b._land = fails_second(b._sync_now), fails_second(b._land)
    with pytest.raises(RuntimeError, match="Connection closed"):
        b.step(last, final=True)
    assert b.version[0] == last and b.version[1] < 0  # inside the step: some of its operations not done
    shared, node = b.held_state()
    again = copy.deepcopy(model)
    again.load_state_dict(broken.state_dict())
    c = _outer(again, **kwargs)
    c.load_held(copy.deepcopy(shared), copy.deepcopy(node))
    c.resume()
    assert c.version == (last, 0) and c.syncs == a.syncs
    for p, q in zip(straight.parameters(), again.parameters()):
        assert torch.equal(p, q)
