"""Resuming on another layout: the data position in global samples, the learning-rate policy and
the layout history, through the trainer's own per-rank loop, one launch per layout.

A 2x2 run stops after 10 steps (global batch 4 x 8 = 32 of 256 samples: epoch 0 is 8 steps, so epoch 1 is
2 steps in). It is resumed by hand on 1x2 with two micro-batches per step (the same global batch) and on
3x1 (global batch 24). The samples each run trains on are recorded by the model itself
(tests/helpers/id_components.py), so what is checked is what the trainer fed, not what a sampler promises.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hybrid.app.checks import check_components, compose_train_config
from hybrid.runtime.launch import launch_local

from helpers import train_workers
from helpers.elastic_scenarios import a_node_killed_in_place, a_node_killed_restart
from helpers.once import once
from helpers.processes import all_gone, descendants

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
ROOT = Path(tempfile.mkdtemp(prefix="hybrid-elastic-tests-"))
N, BATCH = 256, 8
COMMON = ["comm=hierarchical", "comm.timeout_s=120", "optim.lr=0.1", "trainer.log_every=10", "model.width=32",
          "model.depth=2", "model._target_=helpers.id_components.RecordingMLP", "data._target_=helpers.id_components.IndexedVectors",
          "data.kind=vectors", f"data.num_samples={N}", f"data.batch_size={BATCH}", f"data.root={ROOT / 'data'}"]
RECORDS = ROOT / "records"  # a resumed run keeps the model config of the one it resumes, record dir included
FIRST = ROOT / "2x2" / "first"
# comm=diloco, every 4 steps: stopped at step 10, two steps after a sync (the nodes' weights differ), then resumed
# on 3 nodes (node 2 is new) and on 1; "-0" resumes without running a step, so its checkpoint shows what each
# node loaded.
DILOCO = ["comm=diloco", "comm.sync_every=4", f"+model.record_dir={ROOT / 'diloco-records'}"]
DILOCO_FIRST = ROOT / "2x2" / "diloco-first"
# comm.shard_optimizer, stopped at step 10 on 2x2 (2 shards per node): resumed on 1x2 with the same global batch (the
# shards re-cut for a world of 2), and on 3x1 under hierarchical (one worker per node: the whole optimizer each).
ZERO = ["comm=sharded", "comm.shard_optimizer=true", "optim=adamw", "optim.lr=0.001", "trainer.max_steps=20",
        f"+model.record_dir={ROOT / 'zero-records'}"]
ZERO_FIRST = ROOT / "2x2" / "zero-first"
PLANS = {
    "2x2": [("straight", ["trainer.max_steps=20", f"+model.record_dir={ROOT / 'straight-records'}"]),
            ("first", ["trainer.max_steps=20", "trainer.stop_after=10", f"+model.record_dir={RECORDS}"]),
            ("diloco-first", [*DILOCO, "trainer.max_steps=20", "trainer.stop_after=10"]),
            ("zero-straight", ZERO), ("zero-first", [*ZERO, "trainer.stop_after=10"])],
    "1x2": [("accum", ["trainer.max_steps=20", "trainer.grad_accum_steps=2", f"+model.record_dir={RECORDS}",
                       f"trainer.resume={FIRST}"]),
            ("diloco-one", [*DILOCO, "trainer.max_steps=20", f"trainer.resume={DILOCO_FIRST}"]),
            ("zero-accum", [*ZERO, "trainer.grad_accum_steps=2", f"trainer.resume={ZERO_FIRST}"])],
    "3x1": [("three", ["trainer.max_steps=18", "trainer.elastic_lr=scale", f"+model.record_dir={RECORDS}",
                       f"trainer.resume={FIRST}"]),
            ("diloco-three-0", [*DILOCO, "trainer.max_steps=10", f"trainer.resume={DILOCO_FIRST}"]),
            ("diloco-three", [*DILOCO, "trainer.max_steps=20", f"trainer.resume={DILOCO_FIRST}"]),
            ("zero-three", [*ZERO, "comm=hierarchical", f"trainer.resume={ZERO_FIRST}"])],
}


def settings(layout: str, overrides: list[str]):
    nnodes, nproc = map(int, layout.split("x"))
    return compose_train_config([*COMMON, f"cluster.nnodes={nnodes}", f"cluster.nproc_per_node={nproc}", *overrides])


@once
def job(layout: str) -> dict:
    if layout != "2x2":
        job("2x2")  # the checkpoint the others resume
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    plan = [(name, settings(layout, overrides)) for name, overrides in PLANS[layout]]
    check_components(plan[0][1])  # generates the data once, before the ranks start
    return launch_local(plan[0][1].layout, train_workers.runs, (str(ROOT / layout), plan), timeout_s=300)[0]


def batches(world: int) -> list[list[list[int]]]:
    """Per rank of a run on ``world`` ranks, the index batches it trained on, in order. Each rank's first
    forward, on the dataset's first samples before training (DDP settles its buckets), is not a step."""
    out = []
    for rank in range(world):
        rows = [[int(i) for i in line.split()] for line in (RECORDS / f"w{world}-rank{rank}.txt").read_text().splitlines()]
        assert rows[0] == list(range(BATCH)), rows[0]
        out.append(rows[1:])
    return out


def checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def test_the_first_run_reads_one_global_order_a_global_batch_at_a_time():
    job("2x2")
    first = batches(4)
    assert all(len(rows) == 10 for rows in first)
    epoch0 = [i for step in range(8) for rows in first for i in rows[step]]
    assert sorted(epoch0) == list(range(N))  # every sample once in epoch 0


@pytest.mark.parametrize("layout, world, micro", [("3x1", 3, 1), ("1x2", 2, 2)])
def test_a_resume_on_another_world_size_reads_exactly_the_epochs_remaining_samples(layout, world, micro):
    job(layout)
    before = batches(4)
    seen_in_epoch1 = {i for rows in before for batch in rows[8:10] for i in batch}
    assert len(seen_in_epoch1) == 2 * 4 * BATCH
    after = batches(world)
    per_step = world * micro * BATCH
    steps_left = (N - len(seen_in_epoch1)) // per_step  # 192 / 24 = 8 on 3x1, 192 / 32 = 6 on 1x2
    rest = [i for k in range(steps_left * micro) for rows in after for i in rows[k]]
    assert len(rest) == len(set(rest)) == N - len(seen_in_epoch1)
    assert set(rest) == set(range(N)) - seen_in_epoch1  # none twice, none skipped


def test_the_same_global_batch_on_another_layout_continues_like_the_straight_run():
    """1x2 with two micro-batches per step reads the same 32 samples per step as 2x2 did: resumed there at
    step 10, it ends where the straight 2x2 run ends (float sums in another order: rtol 1e-5)."""
    results = job("1x2")
    straight, resumed = checkpoint(ROOT / "2x2" / "straight"), checkpoint(ROOT / "1x2" / "accum")
    for key, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert results["accum"]["membership"] == [
        {"step": 0, "nnodes": 2, "world_size": 4, "global_batch": 32, "why": "start"},
        {"step": 10, "nnodes": 1, "world_size": 2, "global_batch": 32, "why": f"resumed from {FIRST}"}]
    assert resumed["scheduler"]["base_lrs"] == straight["scheduler"]["base_lrs"]  # same global batch: lr kept


def test_a_sharded_optimizers_checkpoint_is_cut_again_for_the_layout_that_resumes_it():
    """comm.shard_optimizer writes whole tensors, so a 2x2 checkpoint (two shards per node) resumes on 1x2 with the
    same global batch and ends where the straight 2x2 run ends (rtol 1e-5), and on 3x1 under hierarchical (one
    shard per node: every worker the whole optimizer) with identical replicas and whole-tensor Adam state."""
    assert job("1x2")["zero-accum"]["param_checksums_identical"]
    straight, accum = checkpoint(ROOT / "2x2" / "zero-straight"), checkpoint(ROOT / "1x2" / "zero-accum")
    for key, tensor in straight["model"].items():
        torch.testing.assert_close(accum["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    for i, entry in straight["optimizer"]["state"].items():
        for key, tensor in entry.items():
            torch.testing.assert_close(accum["optimizer"]["state"][i][key], tensor, rtol=1e-5, atol=1e-6)
    three = job("3x1")["zero-three"]
    assert three["param_checksums_identical"] and three["steps_run"] == 10 and three["shard_optimizer"]
    assert three["optimizer_state_bytes"] == [three["optimizer_state_bytes"][0]] * 3  # g=1: all of it, each
    saved = checkpoint(ROOT / "3x1" / "zero-three")
    params = dict(zip(saved["optimizer"]["param_groups"][0]["params"], saved["model"].values()))
    for i, entry in saved["optimizer"]["state"].items():
        assert entry["exp_avg"].shape == params[i].shape and torch.isfinite(entry["exp_avg_sq"]).all(), i


def test_elastic_lr_scale_follows_the_global_batch_and_the_history_says_why():
    results = job("3x1")
    metrics = results["three"]
    assert metrics["steps"] == 18 and metrics["world_size"] == 3 and metrics["param_checksums_identical"]
    assert metrics["membership"][-1] == {"step": 10, "nnodes": 3, "world_size": 3, "global_batch": 24,
                                         "why": f"resumed from {FIRST}"}
    first, three = checkpoint(FIRST), checkpoint(ROOT / "3x1" / "three")
    assert three["scheduler"]["base_lrs"] == pytest.approx([b * 24 / 32 for b in first["scheduler"]["base_lrs"]])
    assert three["membership"] == metrics["membership"] and three["global_batch"] == 24


def test_diloco_resumed_on_more_or_fewer_nodes_continues_each_nodes_own_weights_and_ends_as_one():
    """A 2-node DiLoCo checkpoint taken between syncs holds two different models. Resumed on 3 nodes, nodes 0 and 1
    continue from their own saved weights, inner optimizer state and the outer loop's, the new node 2 from node
    0's; the next syncs average over three and the run ends with one model. Resumed on 1 node: it continues
    node 0's and ends."""
    results = job("3x1")
    saved = checkpoint(DILOCO_FIRST)["diloco"]["nodes"]
    assert len(saved) == 2 and any(not torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in saved[0]["model"])
    loaded = checkpoint(ROOT / "3x1" / "diloco-three-0")["diloco"]["nodes"]
    for node, source in zip(loaded, (saved[0], saved[1], saved[0])):
        for key in source["model"]:
            assert torch.equal(node["model"][key], source["model"][key]), key
        for s1, s2 in zip(node["optimizer"]["state"].values(), source["optimizer"]["state"].values()):
            assert torch.equal(s1["momentum_buffer"], s2["momentum_buffer"])
    # The outer state, saved as node 0's two workers' shares (2x2), taken back by one worker per node (3x1) and
    # saved again as one share: the same global weights, tensor by tensor.
    saved_global = {i: g for share in checkpoint(DILOCO_FIRST)["diloco"]["outer_shares"] for i, g in share["global"].items()}
    (loaded_share,) = checkpoint(ROOT / "3x1" / "diloco-three-0")["diloco"]["outer_shares"]
    assert len(checkpoint(DILOCO_FIRST)["diloco"]["outer_shares"]) == 2
    assert sorted(loaded_share["global"]) == sorted(saved_global)
    assert all(torch.equal(g, saved_global[i]) for i, g in loaded_share["global"].items())
    three = results["diloco-three"]
    assert three["param_checksums_identical"] and three["nnodes"] == 3 and three["steps_run"] == 10
    assert three["diloco"]["outer_steps"] == saved[0]["outer"]["syncs"] + 3  # at 12, 16 and 20
    one = job("1x2")["diloco-one"]
    assert one["param_checksums_identical"] and one["nnodes"] == 1 and one["steps_run"] == 10


# 3x1 and 3x2 with comm=hierarchical pass too (run by hand with this test: 28 s and 44 s here); for its time CI
# keeps 3x2 sharded (intra and cross groups rebuilt); the leaders' group is rebuilt on a smaller membership in
# tests/test_testbed.py's link-down run (2x1 hierarchical -> 1 node).
# comm=diloco (every 4 steps, so the kill lands between syncs): the two left continue their own nodes' weights from
# the checkpoint and the syncs after it average over two.
# Node 0 too: an elastic job's rendezvous store runs in a process of its own (hybrid.runtime.rdzv_store), so node 0
# hosts nothing the others need and is lost like any other; the lowest surviving rank then writes checkpoints and
# metrics.
# (Node 0 of 3x1 hierarchical with restarts: the rejoin test below, which then starts it again.)
@pytest.mark.parametrize("nproc, comm, lost", [(2, "sharded", 0), (1, "diloco", 2)])
@pytest.mark.background  # mostly waits (the lost node's heartbeat, the rendezvous): beside the first tiers
def test_a_node_killed_mid_run_leaves_the_others_to_finish_on_a_smaller_membership(nproc, comm, lost, tmp_path):
    """3 nodes, cluster.min_nnodes=2: node ``lost``'s agent and its workers are SIGKILLed after the step-10
    checkpoint. The other two re-rendezvous, rebuild their groups over two nodes, resume from the last
    checkpoint on the smaller world and finish every step with identical replicas."""
    a_node_killed_restart(nproc, comm, lost, tmp_path)


@pytest.mark.background  # mostly waits (the lost node's heartbeat): beside the first tiers
def test_in_place_streaming_diloco_goes_on_with_each_nodes_own_weights_and_syncs_over_the_survivors(tmp_path):
    """3x2 comm=diloco, H=8 in 2 fragments, overlapped, fp8, its inner AdamW sharded over each node's workers
    (comm.shard_optimizer): node 2 SIGKILLed after step 12 (an exchange that included it left at step 12): every
    survivor redoes it over the survivors (or all keep it, where it arrived), keeps its own weights and inner shard
    (nothing moves among them), nothing is read from disk, and the run ends with one model on every rank."""
    import json
    import re

    out = a_node_killed_in_place(2, "diloco", 2, tmp_path, after=12, steps=24,
                                 extra=("comm.sync_every=8", "comm.fragments=2", "comm.overlap=true",
                                        "comm.inter_compression=fp8", "comm.shard_optimizer=true", "optim=adamw"))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    diloco = metrics["diloco"]
    assert (diloco["fragments"], diloco["overlap"], diloco["compression"]) == (2, True, "fp8")
    assert diloco["outer_steps"] >= 6  # fragments sync every 4 steps: 4, 8, ..., 24, and the end's
    adam = 2 * metrics["param_bytes"]  # both moments of every parameter: what one unsharded worker holds
    assert metrics["shard_optimizer"] and all(0.45 * adam < held < 0.55 * adam for held in metrics["optimizer_state_bytes"])
    moved = re.findall(r"^in place: state as of step \d+ .*", out, re.MULTILINE)[-1]
    # Each survivor keeps its own inner shard; a node behind the other takes the other's, shard j from its worker j.
    for rank, sender in re.findall(r"rank (\d+) <- [^;]*?optimizer [\d.]+ [KMG]?i?B from rank (\d+)", moved):
        assert int(rank) % 2 == int(sender) % 2, moved


@pytest.mark.background  # mostly waits (the lost node's heartbeat): beside the first tiers
def test_in_place_adaptive_loses_a_node_inside_a_diloco_phase_and_switches_back_on_the_survivors(tmp_path):
    """3x1 comm=adaptive, DiLoCo from step 4 to 14 (comm.adapt_plan), its optimizer node-sharded (comm.shard_optimizer:
    one worker per node holds its whole shard): node 2 SIGKILLed after step 12, inside the DiLoCo phase; the
    survivors go on in it and leave it at step 14 together, ending identical."""
    import json

    a_node_killed_in_place(1, "adaptive", 2, tmp_path, after=12, steps=24,
                           extra=("comm.adapt_every=0", "comm.adapt_plan=[[4,diloco],[14,hierarchical]]",
                                  "comm.sync_every=4", "comm.shard_optimizer=true"))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [(s["step"], s["to"]) for s in metrics["switches"]] == [(4, "diloco H=4"), (14, "hierarchical")]
    assert metrics["shard_optimizer"]


@pytest.mark.background  # mostly waits (torchrun's start, the lost node's heartbeat)
def test_in_place_under_two_real_torchrun_agents_and_the_survivors_agent_exits_at_once(tmp_path):
    """Two ``torchrun`` agents (``--nnodes 1:2``, c10d rendezvous on a store off the nodes, hybrid's
    ``python -m hybrid.runtime.rdzv_store``), ``cluster.recovery=in_place`` with nothing exported: node 1's
    torchrun and its worker are SIGKILLed after step 11. Node 0's worker keeps its process, continues on one
    node, finishes every step, and its torchrun exits 0 well before torch's 300 s exit barrier (the workers
    count the lost agent in there)."""
    import json
    import os
    import signal
    import subprocess
    import threading
    import time

    from hybrid.runtime.rdzv_store import start_store

    from helpers.background import track

    store = start_store("127.0.0.1", 0)
    try:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", store.endpoint,
                "--rdzv-id", "in-place", "--max-restarts", "1", "--monitor-interval", "0.1", "-m", "hybrid.train",
                "cluster.nnodes=2", "cluster.nproc_per_node=1", "cluster.min_nnodes=1", "cluster.max_restarts=1",
                "cluster.recovery=in_place", f"cluster.rdzv_endpoint={store.endpoint}", "comm=hierarchical",
                "comm.timeout_s=30", "trainer.max_steps=60", "trainer.log_every=1", "model.width=512",
                "data.num_samples=1024", f"data.root={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        agents = [track(subprocess.Popen([torchrun, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True))
                  for _ in range(2)]
        outputs: list[list[str]] = [[], []]
        readers = [threading.Thread(target=lambda a=a, o=o: o.extend(a.stdout), daemon=True)
                   for a, o in zip(agents, outputs)]
        for reader in readers:
            reader.start()
        try:
            deadline = time.monotonic() + 180
            while not any("step 11/" in "".join(o) for o in outputs) and time.monotonic() < deadline:
                time.sleep(0.05)
            # Which torchrun runs rank 0 (it prints the steps) is the rendezvous's choice: the other one is lost.
            first = next(i for i, o in enumerate(outputs) if "step 11/" in "".join(o))
            lost = agents[1 - first]
            before = set(descendants(agents[first].pid))
            for pid in [lost.pid, *descendants(lost.pid)]:  # torchrun starts its workers in sessions of their own
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            agents[first].wait(timeout=120)  # torch's exit barrier alone would hold it 300 s
            exited = time.monotonic() - killed
            readers[first].join(timeout=10)
            lost.wait(timeout=10)
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
        out = "".join(outputs[first])
        output = out
        assert agents[first].returncode == 0, output[-3000:]
        metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
        assert metrics["steps"] == 60 and metrics["nnodes"] == 1 and metrics["param_checksums_identical"]
        assert [m["why"] for m in metrics["membership"]] == ["start", "in place: node(s) [1] lost"]
        assert "lost node(s)' agents counted in at torchrun's exit barrier" in output
        assert "restart" not in " ".join(m["why"] for m in metrics["membership"])
        assert before, "no worker under the surviving torchrun"
        # Its agent exited with the job, not 300 s after it.
        assert exited < 60 and all_gone(sorted(before), within_s=15)
    finally:
        store.stop()
