"""optim.no_decay: two param groups as nanoGPT makes them (biases and norm weights without weight decay), held to
the Hugging Face Trainer's own choice on GPT-2, and through the trainer in every comm (ZeRO's two included), in its
checkpoints and on resume; the runs live in the trainer's shared job (tests/helpers/trainer_job.py)."""

from __future__ import annotations

import pytest
import torch

from hybrid.app.checks import check_resume
from hybrid.app.components.optim import parameter_groups
from hybrid.app.setup import build_model

from helpers.trainer_job import checkpoint, job, model_state, settings

GPT2 = ["model=gpt2", "model.width=32", "model.depth=2", "model.heads=4", "data=text", "data.seq_len=32"]


def _close(got: dict, ref: dict) -> None:
    for key, tensor in ref.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.unit
def test_the_decayed_tensors_are_the_hugging_face_trainers_on_gpt2_and_the_others_get_none():
    """transformers' Trainer decays every parameter outside its LayerNorm layers that is not a bias; on GPT-2
    (Conv1D biases, LayerNorms, tied wte/lm_head) that is exactly the tensors of two or more dimensions."""
    from transformers import Trainer

    gpt2 = build_model(settings("2x2", GPT2).model, torch.device("cpu"))
    decay, no_decay = parameter_groups(gpt2, True)
    theirs = {id(gpt2.get_parameter(name)) for name in Trainer.get_decay_parameter_names(None, gpt2)}
    assert {id(p) for p in decay["params"]} == theirs
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay  # the optimizer's own, unchanged
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in gpt2.parameters()} - theirs
    assert parameter_groups(gpt2, False) == list(gpt2.parameters())
    linear = torch.nn.Linear(4, 4, bias=False)  # nothing to leave undecayed: one group, not an empty second
    assert [len(g["params"]) for g in parameter_groups(linear, True)] == [1]


@pytest.mark.multiprocess
def test_no_decay_runs_alike_in_every_comm_and_differs_from_decaying_everything():
    """AdamW (weight decay 0.1, clipping) with optim.no_decay, 2x2, 20 steps: hierarchical, ZeRO inside the node,
    torch's ZeroRedundancyOptimizer and FSDP2 end within assert_close of comm=ddp's, identical replicas each;
    the checkpoints hold two groups, 0.1 over the matrices and 0.0 over the vectors (ZeRO's Adam moments within
    assert_close of DDP's); and the run is another than the one that decays every tensor."""
    root, results = job("2x2")
    ddp = checkpoint(root / "ddp-nodecay")
    names = list(ddp["model"])
    groups = ddp["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    state = ddp["optimizer"]["state"]  # numbered group after group, as torch numbers them
    assert [sorted(state[i]["exp_avg"].dim() >= 2 for i in g["params"]) for g in groups] == [
        [True] * 4, [False] * 4]  # the MLP's 4 weight matrices, then its 4 biases
    for comm in ("hierarchical", "zero", "ddp-zero-redundancy", "hsdp"):
        _close(model_state(root / f"{comm}-nodecay"), ddp["model"])
        assert results[f"{comm}-nodecay"]["param_checksums_identical"], comm
    zero = checkpoint(root / "zero-nodecay")["optimizer"]
    assert zero["param_groups"] == groups
    for i, entry in ddp["optimizer"]["state"].items():
        for key, tensor in entry.items():
            torch.testing.assert_close(zero["state"][i][key], tensor, rtol=1e-5, atol=1e-6, msg=f"{i} {key}")
    hsdp = checkpoint(root / "hsdp-nodecay")["optimizer"]["param_groups"]  # keyed by name (torch's DCP form)
    assert [g["weight_decay"] for g in hsdp] == [0.1, 0.0]
    assert sorted(hsdp[1]["params"]) == sorted(n for n in names if ddp["model"][n].dim() < 2)
    decayed_all = model_state(root / "ddp-adamw")
    biases = [n for n in names if n.endswith("bias")]
    assert biases and all(not torch.equal(decayed_all[n], ddp["model"][n]) for n in biases)


@pytest.mark.multiprocess
def test_no_decay_resumes_bitwise_and_diloco_keeps_its_exact_case():
    """ZeRO with the two groups stopped at step 13 and resumed: the straight run's bits, moments included.
    DiLoCo's exact case (H=1, outer SGD lr 1) with SGD's weight decay on the matrices only: DDP's run with it."""
    root, results = job("2x2")
    straight, resumed = checkpoint(root / "zero-nodecay"), checkpoint(root / "zero-nodecay-13")
    assert resumed["step"] == 20 and results["zero-nodecay-13"]["steps_run"] == 7
    assert resumed["optimizer"]["param_groups"] == straight["optimizer"]["param_groups"]
    for key, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][key], tensor), key
    for i, entry in straight["optimizer"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(resumed["optimizer"]["state"][i][key], tensor), (i, key)
    _close(model_state(root / "diloco-exact-nodecay"), model_state(root / "ddp-sgd-nodecay"))
    assert results["diloco-exact-nodecay"]["param_checksums_identical"]
    assert not torch.equal(model_state(root / "ddp-sgd-nodecay")["net.0.weight"],
                           model_state(root / "ddp-plain-sgd")["net.0.weight"])  # the decay took effect


@pytest.mark.multiprocess
def test_a_resume_that_would_group_the_parameters_otherwise_is_refused_before_start():
    root, _ = job("2x2")
    with pytest.raises(ValueError, match=r"was trained with optim.no_decay=false \(one param group\).* resume it with "
                                         r"optim.no_decay=false$"):
        check_resume(str(root / "ddp-adamw"), None, None, "ddp", no_decay=True)
    with pytest.raises(ValueError, match=r"was trained with optim.no_decay=true \(two param groups\)"):
        check_resume(str(root / "ddp-nodecay"), None, None, "ddp", no_decay=False)
    check_resume(str(root / "ddp-nodecay"), None, None, "ddp", no_decay=True)  # made the same way: accepted
