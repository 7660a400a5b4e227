"""The peers inside the trainer: torch FSDP2 as HSDP (comm=hsdp) and torch's own DDP comm hooks
(comm.torch_hook), checked against plain torch DDP on the runs of tests/test_trainer.py's 2x2 job."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.app.checks import check_components, check_devices, check_resume
from hybrid.app.replicas.hsdp import shard_units
from hybrid.app.setup import build_model

from helpers.trainer_job import job, model_state, settings


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - v).abs().max().item() for k, v in b.items())


@pytest.mark.multiprocess
def test_hsdp_ends_within_tolerance_of_plain_ddp_with_identical_replicas_of_each_shard():
    """Parity: FSDP2 on a (2 nodes, 2 workers) mesh, 20 steps, the same data and seed as DDP."""
    root, results = job("2x2")
    reference, state = model_state(root / "ddp"), model_state(root / "hsdp")
    assert set(state) == set(reference)  # a full state dict, under the module's own names
    for key, tensor in reference.items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    metrics = results["hsdp"]
    assert metrics["comm"] == "hsdp" and metrics["steps"] == 20 and metrics["param_checksums_identical"]
    assert metrics["param_bytes"] == results["ddp"]["param_bytes"]  # the whole model's, not a shard's
    checkpoint = torch.load(root / "hsdp" / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["state_dict_kind"] == "torch.distributed.checkpoint"
    assert set(checkpoint["optimizer"]["state"]) == {k for k in reference}  # keyed by parameter name


@pytest.mark.multiprocess
def test_hsdp_resumes_bitwise_through_torchs_distributed_state_dicts():
    """10 steps, a checkpoint gathered by get_state_dict, a new run sharding it back by set_state_dict: the
    same bits as 20 straight steps, momentum included; replicas of each shard checked every 5 steps."""
    root, results = job("2x2")
    straight = torch.load(root / "hsdp" / "checkpoints" / "last.pt", weights_only=True)
    resumed = torch.load(root / "hsdp-resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert straight["step"] == resumed["step"] == 20 and results["hsdp-resumed"]["steps_run"] == 10
    for key in straight["model"]:
        assert torch.equal(straight["model"][key], resumed["model"][key]), key
    for key, s in straight["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], resumed["optimizer"]["state"][key]["momentum_buffer"]), key


@pytest.mark.multiprocess
def test_hsdp_accumulates_and_clips_like_the_other_comms():
    """FSDP2's set_requires_gradient_sync for the micro-steps, and clip_grad_norm_ over sharded gradients (a
    norm over every shard): the same runs as hierarchical's accumulation and DDP's clipping."""
    root, _ = job("2x2")
    for mine, theirs in (("hsdp-accum", "accum"), ("hsdp-clip", "clip-ddp")):
        state, reference = model_state(root / mine), model_state(root / theirs)
        for key, tensor in reference.items():
            torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{mine} {key}")


@pytest.mark.multiprocess
def test_hsdp_on_gpt2_and_the_readme_example_matches_ddp_with_tied_weights_kept():
    """transformers' GPT-2 (a block per fully_shard, tied embeddings left in the root's unit) and
    docs/your-model.md's worked example (frozen layer, BatchNorm, a block used twice, a tied head) under FSDP2 end
    where DDP does."""
    root, results = job("2x2")
    for name in ("gpt2", "mine"):
        reference, state = model_state(root / f"{name}-ddp"), model_state(root / f"{name}-hsdp")
        for key, tensor in reference.items():
            torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert results[f"{name}-hsdp"]["param_checksums_identical"]
    gpt2 = model_state(root / "gpt2-hsdp")
    assert torch.equal(gpt2["model.lm_head.weight"], gpt2["model.transformer.wte.weight"])
    assert results["gpt2-hsdp"]["final_loss"] < 0.8 * math.log(256)


@pytest.mark.unit
def test_the_units_are_blocks_and_no_unit_splits_a_tied_weight():
    gpt2 = build_model(settings("2x2", ["model=gpt2", "model.width=32", "model.depth=2", "model.heads=4",
                                       "data=text", "data.seq_len=32"]).model, torch.device("cpu"))
    units = shard_units(gpt2)
    assert [type(u).__name__ for u in units] == ["GPT2Block", "GPT2Block"]  # wte/lm_head (tied) stay in the root
    mlp = build_model(settings("2x2", []).model, torch.device("cpu"))
    assert [type(u).__name__ for u in shard_units(mlp)] == ["Linear"] * 4
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    tied[1].weight = tied[0].weight
    assert shard_units(tied) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_torchs_own_hooks_run_on_ddp_and_train_like_it(hook):
    """torch's fp16_compress_hook and powerSGD_hook, registered by comm.torch_hook: another run than DDP's
    (the hook ran), identical replicas, the loss where DDP's is."""
    root, results = job("2x2")
    name = f"ddp+{hook}-hook"
    metrics = results[name]
    assert metrics["param_checksums_identical"] and metrics["comm"] == "ddp"
    gap = _gap(model_state(root / name), model_state(root / "ddp"))
    assert 0 < gap < (5e-3 if hook == "fp16" else 0.5), gap  # fp16 rounding; PowerSGD's rank-1 approximation
    assert abs(metrics["final_loss"] - results["ddp"]["final_loss"]) < 0.05 * results["ddp"]["final_loss"]


@pytest.mark.multiprocess
def test_the_bf16_hook_and_a_checkpoint_of_the_other_kind_are_refused_before_start():
    with pytest.raises(ValueError, match=r"comm.torch_hook=bf16: .*NCCL on CUDA"):
        check_devices(settings("2x2", ["comm=ddp", "comm.torch_hook=bf16"]))
    with pytest.raises(ValueError, match=r"comm.torch_hook=fp16 registers .* comm=hierarchical"):
        settings("2x2", ["comm=hierarchical", "comm.torch_hook=fp16"])
    with pytest.raises(ValueError, match=r"comm.torch_hook=powersgd on gloo: this model.s 51.3 KiB .* more than one"):
        check_components(settings("2x2", ["comm=ddp", "comm.torch_hook=powersgd"]))  # 0.02 MiB buckets
    check_components(settings("2x2", ["comm=ddp", "comm.torch_hook=powersgd", "comm.bucket_mb=25"]))  # one: fine
    root, _ = job("2x2")
    with pytest.raises(ValueError, match=r"written by comm=hsdp .* resume it with comm=hsdp"):
        check_resume(str(root / "hsdp"), None, None, "ddp")
    with pytest.raises(ValueError, match=r"written by a comm other than hsdp .* resume it with comm=ddp"):
        check_resume(str(root / "ddp"), None, None, "hsdp")
    check_resume(str(root / "hsdp"), None, None, "hsdp")  # its own kind: accepted
