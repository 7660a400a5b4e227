"""cluster.intra_mode=thread (one process per node driving its replicas) trains what process mode trains."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hybrid.app.checks import check_components, compose_train_config
from hybrid.app.replicas.node_threads import replica_topology
from hybrid.core.topology import Topology

from helpers import train_workers
from helpers.once import once
from helpers.readme_example import write_example

ROOT = Path(tempfile.mkdtemp(prefix="hybrid-node-parallel-tests-"))
# 2 nodes x 2 devices, SGD with momentum; every step checks that all replicas are identical.
ARGS = ["cluster=2x2", "optim=sgd", "optim.lr=0.1", "optim.warmup_steps=2", "trainer.max_steps=5",
        "trainer.log_every=1", "trainer.check_replicas_every=1", "comm.timeout_s=120",
        "cluster.launch_timeout_s=180"]
MLP = ["model.width=32", "model.depth=2", f"data.root={ROOT / 'data'}", "data.num_samples=1024", "data.batch_size=16"]
# docs/your-model.md's package: frozen layer, BatchNorm, shared block, tied head, own data and loss
EXAMPLE = ROOT / "example"
MINE = ["model=mynet", "data=spirals", "loss=smoothed", "data.batch_size=16"]
PLANS = {
    "process": [("plain", []), ("accum", ["trainer.grad_accum_steps=2"]), ("first3", ["trainer.stop_after=3"]),
                ("mine", MINE)],
    "thread": [("plain", []), ("accum", ["trainer.grad_accum_steps=2"]),
               ("first3", ["trainer.stop_after=3"]),
               ("resumed", [f"trainer.resume={ROOT / 'thread' / 'first3'}"]),
               ("from-process", [f"trainer.resume={ROOT / 'process' / 'first3'}"]),
               ("bf16", ["comm.inter_compression=bf16"]),
               ("bf16-first3", ["comm.inter_compression=bf16", "trainer.stop_after=3"]),
               ("bf16-resumed", ["comm.inter_compression=bf16", f"trainer.resume={ROOT / 'thread' / 'bf16-first3'}"]),
               ("mine", MINE)],
}


@pytest.fixture(scope="module", autouse=True)
def _remove_root():
    yield
    shutil.rmtree(ROOT, ignore_errors=True)


def hybrid_train(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid.train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@once
def job(mode: str) -> list[dict]:
    """Every plan of ``mode`` in one launch (workers start once), through the launcher ``python -m hybrid.train``
    uses (one process per node in thread mode); the results of every rank."""
    from hybrid.app.train import launch_job

    if not EXAMPLE.is_dir():
        write_example(EXAMPLE)
        sys.path.insert(0, str(EXAMPLE))  # mypkg, for this process and the spawned workers (they inherit it)
    plan = [(name, compose_train_config([*ARGS, *([] if extra == MINE else MLP), f"cluster.intra_mode={mode}", *extra],
                                        user_dirs=[EXAMPLE / "myconf"])) for name, extra in PLANS[mode]]
    check_components(plan[0][1])  # generate the data once, before the ranks start
    if mode == "thread":
        job("process")  # "from-process" resumes a process-mode checkpoint
    return launch_job(plan[0][1], train_workers.runs, (str(ROOT / mode), plan))


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_same_run(thread_dir: Path, process_dir: Path) -> None:
    thread, process = final_state(thread_dir), final_state(process_dir)
    assert thread["step"] == process["step"] == 5
    for key, tensor in process["model"].items():
        torch.testing.assert_close(thread["model"][key], tensor, rtol=1e-5, atol=1e-7, msg=key)
    assert thread["data"] == process["data"]  # every replica read what its process-mode rank read


@pytest.mark.multiprocess
def test_thread_mode_matches_process_mode_with_one_process_per_node():
    results = job("thread")
    assert len(results) == 2  # ranks: one process per node
    process = job("process")[0]["plain"]
    assert_same_run(ROOT / "thread" / "plain", ROOT / "process" / "plain")
    metrics = json.loads((ROOT / "thread" / "plain" / "metrics.json").read_text())
    assert metrics == results[0]["plain"]
    assert metrics["intra_mode"] == "thread" and process["intra_mode"] == "process"
    assert metrics["world_size"] == 4 and metrics["nnodes"] == 2 and metrics["nproc_per_node"] == 2
    assert len(metrics["peak_rss_mb"]) == 2 and len(process["peak_rss_mb"]) == 4  # one figure per process
    assert metrics["param_checksums_identical"] and metrics["steps"] == 5
    assert metrics["final_loss"] == pytest.approx(process["final_loss"], rel=1e-5)
    assert metrics["samples_per_step"] == process["samples_per_step"] == 4 * 16
    # The same hierarchical algorithm, counted in the same phases: the same bytes.
    assert metrics["bytes"] == process["bytes"] and metrics["bytes"]["inter_allreduce"] > 0
    assert all(metrics["comm_s"][p] > 0 for p in ("intra_reduce", "inter_allreduce", "intra_broadcast"))


@pytest.mark.multiprocess
def test_thread_mode_trains_a_users_model_with_frozen_tied_and_batchnorm_parts_as_process_mode_does():
    """The worked example's model (docs/your-model.md) in thread mode: replicas are deep copies (the tie survives
    in each), only trainable parameters are reduced and stepped (the frozen projection keeps its bits),
    BatchNorm's buffers follow the leader; the parameters end as in process mode under DDP."""
    thread, process = job("thread")[0]["mine"], job("process")[0]["mine"]
    assert_same_run(ROOT / "thread" / "mine", ROOT / "process" / "mine")
    state = final_state(ROOT / "thread" / "mine")["model"]
    assert torch.equal(state["head.weight"], state["class_embedding.weight"])
    assert torch.equal(state["project.weight"], final_state(ROOT / "process" / "mine")["model"]["project.weight"])
    assert thread["param_checksums_identical"] and thread["model"] == "mynet"
    assert thread["final_loss"] == pytest.approx(process["final_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_thread_mode_gradient_accumulation_matches_process_mode():
    thread, process = job("thread")[0]["accum"], job("process")[0]["accum"]
    assert_same_run(ROOT / "thread" / "accum", ROOT / "process" / "accum")
    assert thread["final_loss"] == pytest.approx(process["final_loss"], rel=1e-5)
    assert thread["param_checksums_identical"] and thread["bytes"] == process["bytes"]


@pytest.mark.multiprocess
def test_thread_mode_resumes_its_own_checkpoint_exactly_and_process_mode_checkpoints_too():
    results = job("thread")[0]
    assert results["first3"]["steps_run"] == 3 and results["resumed"]["steps_run"] == 2
    straight, resumed = final_state(ROOT / "thread" / "plain"), final_state(ROOT / "thread" / "resumed")
    for key in straight["model"]:
        assert torch.equal(resumed["model"][key], straight["model"][key]), key
    assert_same_run(ROOT / "thread" / "from-process", ROOT / "process" / "plain")
    assert results["from-process"]["steps_run"] == 2


@pytest.mark.multiprocess
def test_thread_mode_compresses_the_inter_node_hop_like_hierarchical():
    results = job("thread")[0]
    assert results["bf16"]["bytes"]["inter_allreduce"] * 2 == results["plain"]["bytes"]["inter_allreduce"]
    assert results["bf16"]["param_checksums_identical"]
    reference, state = final_state(ROOT / "thread" / "plain")["model"], final_state(ROOT / "thread" / "bf16")["model"]
    gap = max((state[k] - v).abs().max().item() for k, v in reference.items())
    assert 0 < gap < 1e-3, gap  # 16-bit rounding with error feedback, not another run


@pytest.mark.multiprocess
def test_thread_mode_resumes_a_compressed_run_exactly_with_its_nodes_residuals():
    results = job("thread")[0]
    assert results["bf16-resumed"]["steps_run"] == 2
    straight, resumed = final_state(ROOT / "thread" / "bf16"), final_state(ROOT / "thread" / "bf16-resumed")
    for key in straight["model"]:
        assert torch.equal(resumed["model"][key], straight["model"][key]), key
    saved = final_state(ROOT / "thread" / "bf16-first3")["error_feedback"]
    assert len(saved["ranks"]) == 2 and all(r["hierarchical (intra_mode=thread)"]["residuals"] for r in saved["ranks"])


@pytest.mark.unit
def test_replica_topology_numbers_replicas_as_process_mode_ranks():
    processes = Topology(rank=1, nodes=((0,), (1,), (2,)))
    topo = replica_topology(processes, 4)
    assert topo.world_size == 12 and topo.nnodes == 3 and topo.rank == 4 and topo.node_ranks == (4, 5, 6, 7)


@pytest.mark.unit
def test_an_in_process_replica_that_drifts_is_named_by_its_global_rank():
    import torch.distributed as dist

    from hybrid.app.replicas.base import ReplicaDivergence, check_replicas

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        models = [torch.nn.Linear(3, 2) for _ in range(3)]
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
        check_replicas(models, step=1)  # identical: passes
        with torch.no_grad():
            models[1].bias[0] += 1e-3
        with pytest.raises(ReplicaDivergence, match=r"step 2: replicas diverged: rank\(s\) \[1\] hold parameters "
                                                    r"different from rank\(s\) \[0, 2\]"):
            check_replicas(models, step=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_bad_intra_mode_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """The whole path once, as a user runs it; the next case goes through the same precheck in-process."""
    out = hybrid_train("cluster.intra_mode=bogus", cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["error: cluster.intra_mode='bogus' is not one of process, thread"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_thread_mode_with_another_comm_is_refused_in_one_line(tmp_path, monkeypatch):
    from hybrid.app.checks import precheck

    monkeypatch.chdir(tmp_path)
    assert precheck(["cluster.intra_mode=thread", "comm=flat"]) == (
        "comm=flat is not available with cluster.intra_mode=thread, which is hierarchical by construction "
        "(reduce inside the node process, all-reduce among node processes): use comm=hierarchical")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_under_torchrun_thread_mode_wants_one_process_per_node(monkeypatch):
    from hybrid.app.checks import check_torchrun_layout

    cfg = compose_train_config(["cluster.intra_mode=thread", "cluster.nproc_per_node=4"])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"start torchrun with --nproc-per-node 1 \(it has 4\)"):
        check_torchrun_layout(cfg, ["cluster.intra_mode=thread"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_torchrun_layout(cfg, ["cluster.intra_mode=thread", "cluster.nproc_per_node=4"])  # 4 replicas: fine
    assert cfg.process_layout.node_sizes == (1, 1) and cfg.layout.world_size == 8
