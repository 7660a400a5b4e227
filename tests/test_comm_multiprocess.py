"""The communicators and the DDP hook on real multi-process jobs (gloo, CPU).

Every layout is launched once through hybrid.runtime.launch (one torch elastic agent
per simulated node, c10d rendezvous) and runs all its cases inside that job;
the tests below assert on what the ranks returned.
"""

from __future__ import annotations

import pytest

from hybrid.core.topology import Layout
from hybrid.runtime.launch import launch_local

from helpers import workers
from helpers.once import once

pytestmark = pytest.mark.multiprocess

PARITY = {"steps": 10, "width": 64, "depth": 10, "bucket_cap_mb": 0.01}
LONG = {"steps": 30, "width": 32, "depth": 8, "bucket_cap_mb": 0.004}  # 30 steps x >= 8 buckets per comm

PLANS: dict[str, tuple[list[str], dict]] = {
    "1x1": (["collectives", "counters"], {}),
    "1x4": (["collectives", "counters"], {}),
    "2x2": (
        ["collectives", "counters", "bad_layout", "ddp", "ddp_long", "overlap", "compression", "guard", "auto",
         "clock", "profiler", "diloco", "zero", "timeout"],
        {"ddp": PARITY, "ddp_long": {**LONG, "comms": ["flat", "hierarchical", "sharded"]},
         "timeout": {"comm_timeout_s": 4.0}},
    ),
    "4x2": (
        ["collectives", "counters"],
        # 8 ranks on the CI's 2 cores: the largest size here is 1 MB (the 2x2 and 3,1 jobs run 4 MB+); the long
        # many-bucket run is 2x2's (tests/test_trainer.py trains and resumes every comm on 4x2).
        {"collectives": {"sizes": (0, 1, 7, 2**18 + 3)}},
    ),
    # Three ranks per node: uneven shards for sharded, a 3-rank reduce for hierarchical (flat's DDP parity is
    # checked on 2x2 and 3,1; pipeline pieces and windows by the 2x2 job and the tiny-piece runs).
    "2x3": (["collectives", "counters", "ddp", "compression", "zero"],
            {"collectives": {"sizes": (0, 1, 7, 2**18 + 3)}, "zero": {"comms": ["sharded"], "sgd": False},
             "ddp": {**PARITY, "comms": ["ddp", "hierarchical", "sharded"]}}),
    "3,1": (["collectives", "counters", "ddp", "auto"], {"ddp": PARITY}),
    # Three nodes, two of one worker: a leaders' group of three beside intra groups of one (what 3x1 had).
    "2,1,1": (["collectives", "counters"], {}),
}


@once
def job(layout: str) -> list[dict]:
    cases, params = PLANS[layout]
    return launch_local(Layout.parse(layout), workers.run_cases, (cases, params), timeout_s=270)


@pytest.mark.parametrize("layout", list(PLANS))
def test_every_algorithm_matches_torch_flat_allreduce(layout):
    """Sizes 0, 1, 7, 2^20+3 (2^18+3 on 4x2 and 2x3) in fp32/fp64/bf16/fp16: bit-exact for integer-valued fp32/fp64,
    within the summation error bound for bf16/fp16, identical bits on every rank,
    and no fp16 overflow where the mean is representable."""
    results = job(layout)
    declared = Layout.parse(layout)
    assert len(results) == declared.world_size
    # The rendezvous numbers the nodes; the multiset of node sizes is what was asked for.
    assert all(sorted(r["node_sizes"]) == sorted(declared.node_sizes) for r in results)
    failures = [f for r in results for f in r["collectives"]["failures"]]
    assert failures == []


@pytest.mark.parametrize("layout", ["3,1", "2,1,1"])
def test_sharded_on_uneven_nodes_falls_back_to_hierarchical(layout):
    assert all(r["collectives"]["runs_as"]["sharded"] == "hierarchical" for r in job(layout))


@pytest.mark.parametrize("layout", ["2x2", "4x2", "2x3"])
def test_sharded_runs_as_itself_on_equal_nodes(layout):
    assert all(r["collectives"]["runs_as"]["sharded"] == "sharded" for r in job(layout))


@pytest.mark.parametrize("layout", list(PLANS))
def test_phase_counters_report_time_and_schedule_bytes(layout):
    assert [f for r in job(layout) for f in r["counters"]] == []


@pytest.mark.parametrize("layout", ["2x2", "2x3", "3,1"])
def test_ddp_hook_matches_plain_ddp_and_keeps_replicas_identical(layout):
    """10 SGD steps (each with a no_sync micro-batch and an unused branch), >= 8 buckets."""
    for rank_result in job(layout):
        ddp = rank_result["ddp"]
        assert ddp["ddp"]["identical_across_ranks"]
        expected = PLANS[layout][1]["ddp"].get("comms", ["ddp", "flat", "hierarchical", "sharded"])
        assert sorted(ddp) == sorted(expected)
        for comm in (c for c in expected if c != "ddp"):
            run = ddp[comm]
            assert run["buckets"] >= 8, run
            assert run["identical_across_ranks"], comm
            assert run["matches_ddp"] == "yes", (comm, run["matches_ddp"])
            assert run["moved"] > 1e-3  # training actually changed the parameters


def test_ddp_hook_overlaps_communication_with_backward():
    """An earlier bucket finishes its reduction while backward still produces the last one.

    Backward holds (at most 30 s, once) before the first layer until a bucket of this
    step has finished: without overlap none can, and the step records False."""
    for rank_result in job("2x2"):
        overlap = rank_result["overlap"]
        assert sorted(overlap) == ["flat", "hierarchical", "sharded"]
        for comm, run in overlap.items():
            assert run["buckets"] >= 4, (comm, run)
            assert run["seen"] == [True] * 4, (comm, run["seen"])


def test_long_runs_with_many_buckets_finish():
    for rank_result in job("2x2"):
        for comm, run in rank_result["ddp_long"].items():
            assert run["buckets"] >= 8, (comm, run)
            assert run["identical_across_ranks"], comm


@pytest.mark.parametrize("layout", ["2x2", "2x3"])
def test_compressing_the_inter_node_hop_keeps_replicas_identical_and_halves_its_bytes(layout):
    """bf16/fp16 on the leaders' / cross groups' all-reduce only: within the wire's rounding of the
    flat mean, identical bits everywhere, half the inter-node bytes; 10 DDP steps stay near DDP's."""
    for rank_result in job(layout):
        assert rank_result["compression"]["failures"] == []
        for name, run in rank_result["compression"]["training"].items():
            assert run["identical_across_ranks"], name
            # 10 steps of SGD that move the weights by ddp_moved land within 1% of that from DDP's.
            assert run["gap_to_ddp"] < 0.01 * run["ddp_moved"], (name, run)


def test_clocks_are_aligned_to_rank_0_within_the_stated_bound():
    """Every rank shares this machine's monotonic clock, so the true offset is 0 (and -5 s where rank 1's clock was
    set 5 s ahead): the measured offset is within its own error bound (half the best ping-pong) of the truth."""
    for r in job("2x2"):
        clock = r["clock"]
        if r["rank"] == 0:
            assert clock == {"offset_s": 0.0, "error_s": 0.0, "ahead_offset_s": 0.0, "ahead_error_s": 0.0}
            continue
        assert 0 < clock["error_s"] < 0.05
        assert abs(clock["offset_s"]) <= clock["error_s"]
        truth = -5.0 if r["rank"] == 1 else 0.0
        assert abs(clock["ahead_offset_s"] - truth) <= clock["ahead_error_s"], clock


def test_a_users_torch_profiler_shows_the_phases_as_ranges():
    for r in job("2x2"):
        assert r["profiler"] == {"flat": ["hybrid::flat_allreduce"],
                                 "hierarchical": ["hybrid::inter_allreduce", "hybrid::intra_broadcast",
                                                  "hybrid::intra_reduce"] if r["rank"] in (0, 2) else
                                 ["hybrid::intra_broadcast", "hybrid::intra_reduce"],
                                 "sharded": ["hybrid::inter_allreduce", "hybrid::intra_broadcast",
                                             "hybrid::intra_reduce"]}, r["profiler"]


def test_bad_layout_error_names_both_numbers():
    for rank_result in job("2x2"):
        assert rank_result["bad_layout"] == "nnodes (3) x nproc_per_node (2) = 6 != WORLD_SIZE (4)"


def test_failing_collective_raises_within_timeout():
    """The last rank never joins; every other rank gets a CommError naming the
    algorithm, phase and rank within the per-collective timeout for the
    phase it waits in, plus at most the timeout of the phase before it."""
    timeout_s = PLANS["2x2"][1]["timeout"]["comm_timeout_s"]
    results = job("2x2")
    assert results[-1]["timeout"] == {}
    for rank_result in results[:-1]:
        assert sorted(rank_result["timeout"]) == ["flat", "hierarchical", "sharded"]  # all three at once
        for alg, outcome in rank_result["timeout"].items():
            assert outcome["raised"], (alg, rank_result["rank"])
            assert outcome["elapsed"] < 2 * timeout_s + 5, outcome
            assert outcome["message"].startswith(f"{alg} "), outcome
            assert f"on rank {rank_result['rank']} " in outcome["message"]


@pytest.mark.parametrize("layout", ["2x2", "3,1"])
def test_auto_calibrates_alike_everywhere_and_mixes_algorithms_by_bucket_size(layout):
    """comm=auto: every rank fits the same alpha/beta per level; its mean is torch's flat mean to the bit;
    with small buckets sent flat and large ones hierarchical, 10 DDP steps match plain DDP."""
    for rank_result in job(layout):
        auto = rank_result["auto"]
        assert auto["failures"] == []
        assert auto["candidates"] == (["flat", "hierarchical", "sharded"] if layout == "2x2" else ["flat", "hierarchical"])
        # Every candidate priced from its own timed collectives: sharded's levels only where it is a candidate.
        levels = ["intra", "inter", "flat"] + (["sharded_intra", "sharded_inter"] if layout == "2x2" else [])
        assert sorted(auto["model"]) == sorted(levels)
        for level in levels:  # fitted from measurements: finite, non-negative (the fit clamps at 0)
            assert 0 <= auto["model"][level]["beta_s_per_byte"] < float("inf")
            assert 0 <= auto["model"][level]["alpha_s"] < float("inf")
        assert auto["bucket_choices"] == ["flat", "hierarchical"]  # both paths of the hook were taken
        # The link probe ran at start-up among the node leaders (the first rank of each node): both directions
        # of the one pair measured; nobody named with two nodes.
        probe = auto["link_probe"]
        if rank_result["rank"] in (0, rank_result["node_sizes"][0]):
            assert sorted(probe["links_gbps"]) == ["0->1", "1->0"] and min(probe["links_gbps"].values()) > 0
            assert probe["slow_nodes"] == []
        else:
            assert probe is None
        assert auto["matches_ddp"] == "yes", auto["matches_ddp"]
        assert auto["identical_across_ranks"]


def test_diloco_outer_loop_is_data_parallel_in_its_exact_case_and_keeps_nodes_in_step():
    """2x2, the outer loop of hybrid.core.diloco over 20 inner steps. H=1 with an outer SGD of lr 1 and no momentum
    and inner SGD: within assert_close of plain data-parallel SGD (gradients averaged over all four ranks), through
    the leaders and sharded. H=8 with the paper's outer optimizer (Nesterov, lr 0.7, momentum 0.9) and inner
    momentum: the two workers of each node bit-identical after every step, all four after each outer step (8, 16)
    and not in between, and the same bits when a sync goes a tensor at a time; a run rebuilt from its state dicts
    after step 13 equals the straight run bitwise."""
    import torch

    results = job("2x2")
    by_rank = sorted(results, key=lambda r: r["rank"])
    nodes = {r["rank"]: (0 if r["rank"] < 2 else 1) for r in by_rank}  # the rendezvous numbers nodes by rank here
    ref = [torch.tensor(r["diloco"]["reference"]["weights"]) for r in by_rank]
    for inter in ("hierarchical", "sharded"):
        for r, expected in zip(by_rank, ref):
            torch.testing.assert_close(torch.tensor(r["diloco"][f"exact_{inter}"]["weights"]), expected,
                                       rtol=1e-5, atol=1e-6)
        runs = [r["diloco"][f"h8_{inter}"] for r in by_rank]
        assert all(run["syncs"] == 2 for run in runs)
        for step in range(20):
            same_node = all(runs[a]["digests"][step] == runs[b]["digests"][step]
                            for a in range(4) for b in range(4) if nodes[a] == nodes[b])
            everyone = len({run["digests"][step] for run in runs}) == 1
            assert same_node, (inter, step + 1)
            assert everyone == ((step + 1) % 8 == 0), (inter, step + 1)
        # A sync one tensor at a time (the pieces that bound its memory) gives the same bits as one exchange.
        assert [r["diloco"][f"h8_pieces_{inter}"]["digests"] for r in by_rank] == [run["digests"] for run in runs]
    # Sharded, each node's two workers split the outer state by whole tensors (each tensor held once per node, by
    # the same local rank on both nodes), and with two nodes (a sum of two is the same in either order) it gives
    # hierarchical's bits, where every worker holds all of it.
    owned = [r["diloco"]["h8_sharded"]["owned"] for r in by_rank]
    assert sorted(owned[0] + owned[1]) == [0, 1, 2, 3] and owned[0] and owned[1], owned
    assert owned[2:] == owned[:2] and all(r["diloco"]["h8_hierarchical"]["owned"] == [0, 1, 2, 3] for r in by_rank)
    assert [r["diloco"]["h8_sharded"]["digests"] for r in by_rank] == \
        [r["diloco"]["h8_hierarchical"]["digests"] for r in by_rank]
    # Streaming, two fragments (the first layer; the rest), H=8: fragment 0 syncs at steps 4, 12, 20 and fragment 1
    # at 8, 16, each identical on every rank just then, and each node's workers identical throughout.
    runs = [r["diloco"]["h8_streaming"] for r in by_rank]
    assert all(run["syncs"] == 5 for run in runs)
    for step in range(20):
        for fragment, due in ((0, {4, 12, 20}), (1, {8, 16})):
            digests = [run["digests"][step][fragment] for run in runs]
            assert digests[0] == digests[1] and digests[2] == digests[3], (fragment, step + 1)
            assert (len(set(digests)) == 1) == (step + 1 in due), (fragment, step + 1)
    # The pseudo-gradients in fp8 (e4m3, a scale per 128 values): every rank identical at each outer step, ~3.9x
    # fewer bytes per sync than fp32, weights near the uncompressed run's (fp8 keeps ~2 significant digits).
    for inter in ("hierarchical", "sharded"):
        runs = [r["diloco"][f"h8_fp8_{inter}"] for r in by_rank]
        assert all(len({run["digests"][s] for run in runs}) == 1 for s in (7, 15)), inter
        exact = torch.tensor(by_rank[0]["diloco"][f"h8_{inter}"]["weights"])
        rounded = torch.tensor(runs[0]["weights"])
        print(f"fp8 pseudo-gradients, {inter}: weights within {(rounded - exact).abs().max():.2e} of fp32's "
              f"(largest weight {exact.abs().max():.2f})")
        assert 0 < (rounded - exact).abs().max() < 0.05 * exact.abs().max(), (rounded - exact).abs().max()
    fp32, fp8 = (by_rank[0]["diloco"][k]["bytes_per_sync"] for k in ("h8_hierarchical", "h8_fp8_hierarchical"))
    assert 3.8 < fp32 / fp8 < 4, (fp32, fp8)
    straight = [r["diloco"]["h8_hierarchical"]["digests"] for r in by_rank]
    assert [r["diloco"]["h8_resumed"]["digests"] for r in by_rank] == straight
    # Overlapped: the exchange sent at step 8 lands at the end of step 9, so the global weights after step 9 are
    # those the plain run holds after its sync at step 8 (the same pseudo-gradient, the same outer step; later
    # ones differ, as the runs' weights after step 9 do); each node
    # keeps its step 9, so the nodes never agree until finish() syncs at the end. Stopped with the exchange in
    # flight and rebuilt from the state dicts: bitwise the straight run.
    for inter in ("hierarchical", "sharded"):
        plain = [r["diloco"][f"h8_{inter}"] for r in by_rank]
        runs = [r["diloco"][f"h8_overlap_{inter}"] for r in by_rank]
        for run, reference in zip(runs, plain):
            assert run["global_digests"][8] == reference["owned_digests"][7], inter
            assert run["global_digests"][7] != reference["owned_digests"][7], inter  # not landed yet at step 8
        for step in range(20):
            assert all(runs[a]["digests"][step] == runs[b]["digests"][step]
                       for a in range(4) for b in range(4) if nodes[a] == nodes[b]), (inter, step + 1)
            assert len({run["digests"][step] for run in runs}) == 2, (inter, step + 1)
        assert len({run["finished"] for run in runs}) == 1 and all(run["identical_everywhere"] for run in runs)
    straight = [r["diloco"]["h8_overlap_sharded"]["digests"] for r in by_rank]
    assert [r["diloco"]["h8_overlap_resumed"]["digests"] for r in by_rank] == straight
    # The leaders' ring of 2 nodes sends the whole fp32 pseudo-gradient once per sync: (16*32+32+32*4+4) x 4 bytes.
    assert by_rank[0]["diloco"]["h8_hierarchical"]["bytes_per_sync"] == (16 * 32 + 32 + 32 * 4 + 4) * 4


@pytest.mark.parametrize("layout", ["2x2", "2x3"])
def test_a_node_sharded_optimizer_steps_like_torch_ddp_with_the_optimizer_it_wraps(layout):
    """AdamW with two param groups (weight decay on matrices only) and clipping that bites, built by hand over a
    DDP model as a user's program builds it, without settling DDP's buckets (they are rebuilt after the first
    step, and the optimizer's state moves to the new slices), against torch DDP with AdamW itself: the same
    weights, the same clipping norms, the same whole-tensor state_dict on rank 0, 1/g of the state per worker
    (2x3: uneven shards); a NaN in one rank's batch skips that step on every rank. SGD with momentum too."""
    results = job(layout)
    local = int(layout.split("x")[1])
    for r in results:
        runs = r["zero"]
        for name, run in runs.items():
            assert run["matches_ddp"] == "yes", (r["rank"], name, run["matches_ddp"])
            assert run["state_matches_ddp"] == "yes", (r["rank"], name, run["state_matches_ddp"])
        # 2x2 runs AdamW over sharded's and hierarchical's hooks and SGD; 2x3 AdamW over sharded's only.
        assert sorted(runs) == (["adamw-hierarchical", "adamw-sharded", "sgd"] if layout == "2x2" else ["adamw-sharded"])
        if layout == "2x2":
            assert runs["sgd"]["moved"] > 1e-3, runs["sgd"]["moved"]
        for name in [n for n in runs if n.startswith("adamw-")]:
            run = runs[name]
            assert run["norms_match"] == "yes" and run["clipped"] >= 1, (name, run["clipped"])
            assert run["skipped"] == run["ddp_skipped"] == [5]
            assert run["relayouts"] == 1  # DDP's one rebuild of its buckets, after the first step
            # Each worker's slices' moments (plus a step count per slice): 1/g of DDP's, within 15%.
            assert run["ddp_state_bytes"] / local <= run["state_bytes"] <= 1.15 * run["ddp_state_bytes"] / local
    for name in results[0]["zero"]:
        assert len({r["zero"][name].get("params") for r in results}) == 1, name  # every rank's weights alike


def test_the_compression_guard_checks_the_16_bit_hop_and_falls_back_to_full_precision_where_it_is_off():
    """2x2, fp16 on the inter-node hop (tests/helpers/workers.py case_guard): every rank that crosses nodes
    checks alike; ordinary values stay within fp16's rounding and keep compressing; values beyond fp16's range
    read an infinite error, fall back on every such rank at once, and then travel as the uncompressed comm's."""
    for r in job("2x2"):
        for alg in ("hierarchical", "sharded"):
            got = r["guard"][alg]
            if alg == "hierarchical" and not r["guard"]["crosses"]:
                assert got["checks"] == [] and not got["overflow_fell_back"], (r["rank"], got)  # never crosses
                continue
            assert len(got["checks"]) == 2 and all(0 < e < 0.01 for e in got["checks"]), (r["rank"], alg, got)
            assert not got["fell_back"], (r["rank"], alg, got)
            assert got["overflow_checks"] == [float("inf")] and got["overflow_fell_back"], (r["rank"], alg, got)
            assert got["then_uncompressed"], (r["rank"], alg)

