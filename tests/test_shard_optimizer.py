"""comm.shard_optimizer (ZeRO-1 inside the node) through the trainer: against plain DDP, against its own comm
unsharded, and across checkpoints; the runs live in the trainer's shared job (tests/helpers/trainer_job.py)."""

from __future__ import annotations

import pytest
import torch

from hybrid.core.node_sharded_optimizer import whole_state_of_shards

from helpers.trainer_job import checkpoint, job

pytestmark = pytest.mark.multiprocess


def _close_states(got: dict, ref: dict) -> None:
    assert got["param_groups"] == ref["param_groups"]
    assert got["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        assert got["state"][i].keys() == entry.keys(), i
        for key, tensor in entry.items():
            torch.testing.assert_close(got["state"][i][key], tensor, rtol=1e-5, atol=1e-6, msg=f"param {i} {key}")


def _close_models(got: dict, ref: dict) -> None:
    for key, tensor in ref.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("layout", ["2x2", "4x2"])
def test_adamw_with_weight_decay_and_clipping_ends_where_plain_ddp_does_on_half_the_state(layout):
    """20 steps of AdamW (weight decay 0.1, clipping at 1.0): weights and the checkpoint's Adam moments within
    assert_close of comm=ddp's, in torch's own state_dict form; every replica identical; each worker holds
    half of DDP's optimizer state (2 workers per node), within 2%."""
    root, results = job(layout)
    zero, ddp = checkpoint(root / "zero-adamw"), checkpoint(root / "ddp-adamw")
    _close_models(zero["model"], ddp["model"])
    _close_states(zero["optimizer"], ddp["optimizer"])
    assert {"exp_avg", "exp_avg_sq", "step"} == set(zero["optimizer"]["state"][0])
    metrics, reference = results["zero-adamw"], results["ddp-adamw"]
    assert metrics["param_checksums_identical"] and metrics["shard_optimizer"] and not reference["shard_optimizer"]
    assert metrics["optimizer_relayouts"] == 0  # the trainer settles DDP's buckets before the first step
    assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)  # from the shards: DDP's norm
    full = reference["optimizer_state_bytes"]
    assert len(set(full)) == 1 and len(metrics["optimizer_state_bytes"]) == metrics["world_size"]
    for held in metrics["optimizer_state_bytes"]:
        assert abs(held - full[0] / 2) <= 0.02 * full[0] / 2, (held, full[0])


def test_on_four_nodes_sgd_with_momentum_steps_exactly_as_sharded_does_and_like_plain_ddp():
    root, results = job("4x2")
    got, plain, ddp = checkpoint(root / "zero-sgd"), checkpoint(root / "sharded"), checkpoint(root / "ddp")
    for key, tensor in plain["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    _close_models(got["model"], ddp["model"])
    _close_states(got["optimizer"], ddp["optimizer"])
    assert results["zero-sgd"]["param_checksums_identical"] and results["zero-sgd"]["world_size"] == 8


def test_with_sgd_it_steps_exactly_as_its_comm_does_unsharded():
    """SGD with momentum is elementwise and takes no norm: stepping each worker's slices and gathering the
    parameters gives the very bits of stepping whole tensors after a gradient all-gather (sharded with pieces
    cut 8x finer, hierarchical, and the fp16 hop with its error feedback), and plain DDP's to rounding."""
    root, results = job("2x2")
    for zero, plain in (("zero-sgd", "sharded"), ("zero-hierarchical", "hierarchical"), ("zero+fp16", "sharded+fp16")):
        got, ref = checkpoint(root / zero), checkpoint(root / plain)
        for key, tensor in ref["model"].items():
            assert torch.equal(got["model"][key], tensor), (zero, key)
        for i, entry in ref["optimizer"]["state"].items():
            assert torch.equal(got["optimizer"]["state"][i]["momentum_buffer"], entry["momentum_buffer"]), (zero, i)
        assert results[zero]["param_checksums_identical"], zero
    _close_models(checkpoint(root / "zero-sgd")["model"], checkpoint(root / "ddp")["model"])
    assert results["zero+fp16"]["bytes"]["inter_allreduce"] < 0.6 * results["zero-sgd"]["bytes"]["inter_allreduce"]


def test_comm_auto_shards_the_optimizer_choosing_only_among_the_comms_that_gather_the_weights():
    """comm=auto with comm.shard_optimizer (2x2, SGD): its calibrated choice per bucket is hierarchical or sharded,
    never flat (no intra-node phase to gather the updated weights over), and it ends where ZeRO under
    comm=hierarchical does, within assert_close, with identical replicas."""
    root, results = job("2x2")
    auto = results["zero-auto"]
    assert auto["param_checksums_identical"] and auto["shard_optimizer"]
    report = auto["comm_auto"]
    assert report["candidates"] == ["hierarchical", "sharded"], report
    assert report["decisions"] and {d["chosen"] for d in report["decisions"]} <= {"hierarchical", "sharded"}
    _close_models(checkpoint(root / "zero-auto")["model"], checkpoint(root / "zero-hierarchical")["model"])


def test_diloco_shards_its_inner_optimizer_over_the_node_and_ends_where_diloco_does():
    """comm=diloco with comm.shard_optimizer (2x2, H=4, 24 steps of AdamW with weight decay and clipping): the
    model, node 0's inner Adam moments and node 1's (the checkpoint's DiLoCo entry) within assert_close of DiLoCo
    unsharded, every step's replicas identical (each node's workers, all four after each outer step), each
    worker holding half of the inner state; stopped at step 14, inside an interval, it resumes to the same bits."""
    root, results = job("2x2")
    zero, plain = checkpoint(root / "diloco-zero-adamw"), checkpoint(root / "diloco-adamw")
    _close_models(zero["model"], plain["model"])
    _close_states(zero["optimizer"], plain["optimizer"])
    nodes, reference = zero["diloco"]["nodes"], plain["diloco"]["nodes"]
    assert len(nodes) == len(reference) == 2
    # Node 1's inner state is kept as its two workers held it (nobody gathered it), each a half.
    shards = nodes[1]["optimizer_shards"]
    assert len(shards) == 2 and not nodes[1]["optimizer"]["state"]
    _close_states(_node_state(nodes[1]), reference[1]["optimizer"])
    metrics, unsharded = results["diloco-zero-adamw"], results["diloco-adamw"]
    assert metrics["param_checksums_identical"] and metrics["shard_optimizer"]
    assert metrics["diloco"]["outer_steps"] == unsharded["diloco"]["outer_steps"] == 6
    for held, full in zip(metrics["optimizer_state_bytes"], unsharded["optimizer_state_bytes"]):
        assert abs(held - full / 2) <= 0.02 * full / 2, (held, full)
    resumed = checkpoint(root / "diloco-zero-adamw-14")
    assert resumed["step"] == 24 and results["diloco-zero-adamw-14"]["steps_run"] == 10
    for key, tensor in zero["model"].items():
        assert torch.equal(resumed["model"][key], tensor), key
    for node, straight in zip(resumed["diloco"]["nodes"], nodes):
        for i, entry in _node_state(straight)["state"].items():
            for key, tensor in entry.items():
                assert torch.equal(_node_state(node)["state"][i][key], tensor), (i, key)


def _node_state(node: dict) -> dict:
    """A DiLoCo checkpoint's node entry's inner optimizer state as torch lays it (its workers' shards laid whole)."""
    if "optimizer_shards" not in node:
        return node["optimizer"]
    params = list(node["model"].values())  # the MLP's parameters, in the optimizer's order (it has no buffers)
    state = whole_state_of_shards(node["optimizer_shards"], params)
    return {"state": state, "param_groups": node["optimizer"]["param_groups"]}


def test_stopped_at_step_13_and_resumed_it_ends_on_the_straight_runs_bits():
    root, results = job("2x2")
    straight, resumed = checkpoint(root / "zero-adamw"), checkpoint(root / "zero-adamw-13")
    assert straight["step"] == resumed["step"] == 20 and results["zero-adamw-13"]["steps_run"] == 7
    for key, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][key], tensor), key
    for i, entry in straight["optimizer"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(resumed["optimizer"]["state"][i][key], tensor), (i, key)


def test_a_ddp_checkpoint_resumes_sharded_and_a_sharded_one_resumes_under_ddp():
    """Both write torch's optimizer state_dict of whole tensors: each continues the other's step-13 checkpoint
    and ends where its own straight run ends, to rounding."""
    root, results = job("2x2")
    for resumed, straight in (("zero-from-ddp", "zero-adamw"), ("ddp-from-zero", "ddp-adamw")):
        got, ref = checkpoint(root / resumed), checkpoint(root / straight)
        assert got["step"] == 20 and results[resumed]["steps_run"] == 7, resumed
        _close_models(got["model"], ref["model"])
        _close_states(got["optimizer"], ref["optimizer"])
        assert results[resumed]["param_checksums_identical"], resumed


def test_comm_ddp_shards_its_optimizer_with_torchs_zero_redundancy_optimizer_over_the_job():
    """The reference row: torch's ZeroRedundancyOptimizer (whole tensors spread over all four ranks) steps like
    DDP's AdamW, and its checkpoint (consolidated on rank 0) is torch's whole-tensor state_dict too."""
    root, results = job("2x2")
    zero, ddp = checkpoint(root / "ddp-zero-redundancy"), checkpoint(root / "ddp-adamw")
    _close_models(zero["model"], ddp["model"])
    assert zero["optimizer"]["state"].keys() == ddp["optimizer"]["state"].keys()
    for i, entry in ddp["optimizer"]["state"].items():
        torch.testing.assert_close(zero["optimizer"]["state"][i]["exp_avg"], entry["exp_avg"], rtol=1e-5, atol=1e-6)
    held, full = results["ddp-zero-redundancy"]["optimizer_state_bytes"], results["ddp-adamw"]["optimizer_state_bytes"]
    assert sum(held) == pytest.approx(full[0], rel=0.01) and max(held) < full[0]  # spread over the ranks, once
