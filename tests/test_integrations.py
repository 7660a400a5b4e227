"""hybrid inside other people's trainers, started as their users start them (two torchrun agents, 2 nodes x 2
CPU workers): Lightning, the Hugging Face Trainer and an accelerate loop, each trained plain and with hybrid
in one job (tests/helpers/integrations_job.py), compared with torch.testing.assert_close; plus
hybrid.attach's node discovery and refusals in that same job.

The parity checks use SGD (momentum where the library lets us) and no gradient clipping: a communicator
that scales every average by 1.001 must fail them, and each library's run with such a communicator is
shown failing them here (Adam, or clipping to norm 1, would divide that scale out).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from helpers import background
from helpers.once import once
from helpers.torchrun import two_agents

JOB = str(Path(__file__).parent / "helpers" / "integrations_job.py")  # a program: run, never imported
PARITY = {"rtol": 1e-5, "atol": 1e-6}


def run_job() -> list[dict]:
    """Every rank's results; the job runs in the background from the session's start (helpers.background)."""
    with tempfile.TemporaryDirectory(prefix="hybrid-integrations-") as tmp:
        out = Path(tmp)
        agents = two_agents([JOB, str(out)], cwd=out)
        assert [code for code, _ in agents] == [0, 0], "\n".join(output[-4000:] for _, output in agents)
        return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(4)]


background.declare("integrations", lambda test_id: "test_integrations.py::" in test_id, run_job)


@once
def job() -> list[dict]:
    return background.result("integrations")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return job()


def result(ranks, case: str, rank: int = 0) -> dict:
    outcome = ranks[rank][case]
    assert "ok" in outcome, outcome.get("trace", outcome)
    return outcome["ok"]


CASES = [("lightning", "hierarchical"), ("lightning", "sharded"), ("trainer", "hierarchical"),
         ("accelerate", "hierarchical"), ("accelerate", "sharded")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("library,algorithm", CASES)
def test_training_with_hybrid_ends_where_the_library_s_own_ddp_ends_with_identical_ranks(ranks, library, algorithm):
    plain = result(ranks, f"{library}/plain")["weights"]
    hybrid = [result(ranks, f"{library}/{algorithm}", rank) for rank in range(4)]
    print(f"{library} {algorithm}: max |hybrid - plain| = {(hybrid[0]['weights'] - plain).abs().max():.2e}")
    torch.testing.assert_close(hybrid[0]["weights"], plain, **PARITY)
    assert all(torch.equal(r["weights"], hybrid[0]["weights"]) for r in hybrid[1:])
    assert [r["algorithm"] for r in hybrid] == [algorithm] * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("library", ["lightning", "trainer", "accelerate"])
def test_the_parity_check_fails_on_a_communicator_that_scales_by_1_001(ranks, library):
    plain = result(ranks, f"{library}/plain")["weights"]
    sabotaged = result(ranks, f"{library}/sabotaged")["weights"]
    print(f"{library} scaled by 1.001: max |hybrid - plain| = {(sabotaged - plain).abs().max():.2e}")
    with pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(sabotaged, plain, **PARITY)


@pytest.mark.multiprocess
@pytest.mark.parametrize("library", ["lightning", "trainer", "accelerate"])
def test_hierarchical_crosses_nodes_on_leaders_only_once_per_bucket_per_optimizer_step(ranks, library):
    """2 micro-batches per optimizer step (accumulate_grad_batches / gradient_accumulation_steps = 2), 4 steps:
    DDP hands over buckets on the 4 optimizer steps only (no_sync between), and each bucket is reduced once."""
    records = [result(ranks, f"{library}/hierarchical", rank) for rank in range(4)]
    assert [r["nodes"] for r in records] == [((0, 1), (2, 3))] * 4
    assert [r["calls"]["inter_allreduce"] > 0 for r in records] == [True, False, True, False]
    for r in records:
        assert r["steps"] == 4, r
        assert r["buckets_per_step"] >= 2, r  # a model of several buckets
        assert r["calls"]["intra_reduce"] == r["calls"]["intra_broadcast"] == r["buckets"], r
        assert r["calls"]["flat_allreduce"] == 0


@pytest.mark.multiprocess
def test_two_ddp_models_in_one_backward_share_one_attached_communicator(ranks):
    plain = result(ranks, "attach/two-models-plain")["weights"]
    hybrid = [result(ranks, "attach/two-models", rank) for rank in range(4)]
    assert [r["hooked"] for r in hybrid] == [2] * 4
    torch.testing.assert_close(hybrid[0]["weights"], plain, **PARITY)
    assert all(torch.equal(r["weights"], hybrid[0]["weights"]) for r in hybrid[1:])


@pytest.mark.multiprocess
def test_lightning_takes_its_nodes_from_the_trainer_and_the_others_from_torchrun(ranks):
    assert result(ranks, "lightning/hierarchical")["source"] == "node_rank"
    assert result(ranks, "trainer/hierarchical")["source"] == "GROUP_RANK"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,nodes,source", [
    ("ray", ((0, 1), (2, 3)), "NODE_RANK"),
    ("slurm", ((0, 1), (2, 3)), "SLURM_NODEID"),
    ("hostname-two-machines", ((0, 1), (2, 3)), "hostname"),
    ("hostname-one-machine", ((0, 1, 2, 3),), "hostname"),
])
def test_attach_finds_the_nodes_under_each_launcher_s_variables(ranks, case, nodes, source):
    assert [result(ranks, f"nodes/{case}", rank) for rank in range(4)] == [{"nodes": nodes, "source": source}] * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,says", [
    ("refuse/not-ddp", "needs a torch DistributedDataParallel model"),
    ("refuse/already-hooked", "already has a comm hook"),
    ("refuse/builtin-hook", "already has a comm hook"),
    ("refuse/unknown-algorithm", "algorithm='butterfly' is not one of flat, hierarchical, sharded, auto"),
    ("refuse/unknown-option", "unknown comm option(s) bucket_mb"),
    ("refuse/subgroup", "process group of ranks [0, 1], not the default world of 4"),
    ("refuse/disagree", "ranks disagree on algorithm: 'hierarchical' on ranks [0, 1, 2]; 'flat' on ranks [3]"),
    ("lightning/strategy-hook-too", "the strategy's ddp_comm_hook=allreduce_hook"),
])
def test_bad_input_is_refused_in_one_line_on_every_rank(ranks, case, says):
    errors = [ranks[rank][case].get("error", "no error") for rank in range(4)]
    if case == "refuse/subgroup":  # each rank names its own node's group
        assert "ranks [2, 3]" in errors[2]
        errors = errors[:2]
    assert all(says in e and "\n" not in e for e in errors), errors
