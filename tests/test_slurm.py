"""hydra/launcher=slurm: one submitit task per node, each its node's elastic agent; run here with slurm_local."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[test]' brings it")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import hybrid.app.checks  # noqa: E402  also registers the schema (train_schema) with Hydra's ConfigStore
from hybrid.app.checks import compose_train_config  # noqa: E402
from hybrid.runtime.slurm import SlurmNode, in_submitit_task, rdzv_port  # noqa: E402

from helpers.processes import left_after, processes_with_marker  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = ["model.width=32", "model.depth=1", "trainer.max_steps=3", "trainer.log_every=1", "data.num_samples=256",
        "comm.timeout_s=60", "cluster.launch_timeout_s=120", "hydra.launcher.timeout_min=4"]


def launcher_config(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return {k: cfg.hydra.launcher[k] for k in ("_target_", "nodes", "tasks_per_node", "cpus_per_task")}


@pytest.mark.unit
def test_slurm_gets_one_task_per_node_and_local_one_task_per_simulated_node():
    slurm = launcher_config("hydra/launcher=slurm", "cluster=2x4")
    assert slurm == {"_target_": "hydra_plugins.hybrid_slurm_launcher.PerJobSlurmLauncher", "nodes": 2,
                     "tasks_per_node": 1, "cpus_per_task": 4}
    local = launcher_config("hydra/launcher=slurm_local", "cluster.nnodes=3")
    assert (local["nodes"], local["tasks_per_node"]) == (1, 3)


@pytest.mark.unit
def test_slurm_job_script_asks_for_the_nodes_one_task_each(tmp_path, monkeypatch):
    """From the yaml through hybrid's launcher and submitit to the sbatch script (submitit wants an srun)."""
    from hydra_plugins.hybrid_slurm_launcher import PerJobSlurmLauncher

    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", "cluster=2x4", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    executor = PerJobSlurmLauncher(**params)._executor(params)._executor  # AutoExecutor -> SlurmExecutor
    script = executor._make_submission_file_text("python -m x", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4", "--gpus-per-node=4", "--partition=gpu"):
        assert f"#SBATCH {line}\n" in script, script


def submitit_env(monkeypatch, executor: str, **variables: str) -> None:
    """What submitit sets in a task of its job script (Slurm) or of its local controller."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", executor)
    monkeypatch.setenv("SUBMITIT_FOLDER", "/nonexistent")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


@pytest.mark.unit
def test_slurm_tasks_meet_on_the_first_host_at_a_port_of_the_job(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert not in_submitit_task()
    submitit_env(monkeypatch, "slurm", SLURM_JOB_ID="4242", SLURM_NTASKS="4", SLURM_PROCID="2",
                 SLURM_JOB_NODELIST="gpu[07-10]")
    assert in_submitit_task()
    node = SlurmNode.of_this_task(4)
    assert (node.rank, node.nnodes, node.local) == (2, 4, False)
    assert node.rdzv_endpoint == f"gpu07:{rdzv_port('4242')}" and 20000 <= rdzv_port("4242") < 32768
    assert rdzv_port("4242") == rdzv_port("4242") != rdzv_port("4243")
    assert SlurmNode.of_this_task(4, port=29400).rdzv_endpoint == "gpu07:29400"  # cluster.rdzv_port


@pytest.mark.unit
def test_task_count_other_than_nnodes_is_one_line_error(monkeypatch):
    submitit_env(monkeypatch, "local", SUBMITIT_LOCAL_JOB_ID="123", SUBMITIT_LOCAL_NTASKS="1",
                 SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0")
    with pytest.raises(ValueError) as err:
        SlurmNode.of_this_task(2)
    assert str(err.value).startswith("the submitit job has 1 task(s) but cluster.nnodes=2: one task per node")
    assert "\n" not in str(err.value)
    cfg = compose_train_config([])
    cfg.cluster.testbed.enabled = True
    with pytest.raises(ValueError, match="^cluster.testbed.enabled=true starts its own nodes: run it without "
                                         "hydra/launcher=slurm$"):
        hybrid.app.checks.check_testbed(cfg)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("args", "needle"), [
    (["cluster.intra_mode=thread", "comm=flat"],
     "comm=flat: comm=flat is not available with cluster.intra_mode=thread"),
    (["hydra.launcher.tasks_per_node=3"],
     "hydra.launcher asks for 3 task(s) (nodes x tasks_per_node) but cluster.nnodes=2: one task per node"),
])
def test_bad_sweep_job_is_refused_before_anything_is_queued(tmp_path, args, needle):
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "hybrid.train", "-m", "hydra/launcher=slurm_local", "cluster=2x1",
                          *TINY, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("error: sweep job ") and needle in line, out.stderr[-2000:]
    assert not (sweep / ".submitit").exists() and not list(sweep.glob("*/metrics.json"))  # nothing ran


@pytest.mark.multiprocess
@pytest.mark.background  # mostly waits (submitit's polling of its local tasks)
def test_sweep_of_two_layouts_one_elastic_agent_per_node_as_local_submitit_tasks(tmp_path):
    """2 simulated nodes x 1 worker as 2 local tasks, and a 1x1 job beside it: each job gets its own task count."""
    marker = uuid.uuid4().hex
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "hybrid.train", "-m", "hydra/launcher=slurm_local", "cluster=2x1",
           "cluster.nnodes=2,1", *TINY, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "HYBRID_TEST_MARKER": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the submitit controller, its tasks and their workers
        proc.communicate(timeout=10)
        raise
    assert proc.returncode == 0, (out + err)[-4000:]

    # A job's directory: its number and what the sweep varies (the submitit launcher's jobs too).
    jobs = sorted(p.name for p in sweep.iterdir() if p.name[:2] in ("00", "01"))
    assert jobs == ["00_cluster.nnodes:2", "01_cluster.nnodes:1"], jobs
    for job, (nnodes, world) in zip(jobs, [(2, 2), (1, 1)]):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert (metrics["nnodes"], metrics["nproc_per_node"], metrics["world_size"]) == (nnodes, 1, world)
        assert metrics["steps"] == 3 and metrics["param_checksums_identical"]
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", *jobs, "multirun.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "sweep"]  # synthetic data in the cwd

    # submitit's own logs: three tasks ran to completion, two of them the 2-node job's nodes, and
    # exactly one task of each job (the one holding global rank 0) reported the metrics.
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    tasks = sorted(re.search(r"global_rank=(\d+)\((\d+)\)", p.read_text()).groups() for p in logs)
    assert tasks == [("0", "1"), ("0", "2"), ("1", "2")]
    assert all("Job completed successfully" in p.read_text() for p in logs)
    reports = sorted(m.group(1) for p in logs for m in re.finditer(r"metrics: (\S+)", p.read_text()))
    assert reports == [str(sweep / job / "metrics.json") for job in jobs]

    # The local controller ends its tasks just after the results are in.
    left = left_after(lambda: processes_with_marker(marker), within_s=15)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.unit
def test_slurm_warning_stops_every_rank_after_one_agreed_step(tmp_path):
    """Slurm's signal reaches one rank after its step 5 (a real signal, a real store): that rank proposes
    step 7; a rank a step behind sees the proposal before it passes it, so both stop after step 7."""
    import torch.distributed as dist

    from hybrid.app.state.preemption import SignalStop, mark_stopped, wait_for_stop

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        behind = SignalStop(store, signal.SIGUSR2)
        ahead = SignalStop(store, signal.SIGUSR2)  # its handler is the process's now: it gets the signal
        assert behind.stop_after(4) is None and ahead.stop_after(5) is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert ahead.stop_after(5) == 7
        assert behind.stop_after(5) == 7 and behind.stop_after(6) == 7
    finally:
        signal.signal(signal.SIGUSR2, previous)
    since = time.time() - 1
    assert wait_for_stop(tmp_path, since, timeout_s=0.3) is None  # nothing written: the wait ends, no hang
    mark_stopped(tmp_path, 7)
    assert wait_for_stop(tmp_path, since, timeout_s=5) == 7
    assert wait_for_stop(tmp_path, time.time() + 60, timeout_s=0.3) is None  # an older stop does not count


@pytest.mark.unit
def test_slurm_testbed_refuses_bad_input_in_one_line(capsys, tmp_path):
    from hybrid.tools.testbed_cli import main

    assert main(["slurm", "up", "--nodes", "0", "--dir", str(tmp_path / "cluster")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    assert "--nodes 0: a Slurm testbed has 1..64 nodes" in err or "the Slurm testbed needs" in err
    assert not (tmp_path / "cluster").exists()  # nothing made


@pytest.mark.unit
def test_slurm_testbed_down_never_removes_a_folder_that_is_not_its_own(capsys, tmp_path):
    from hybrid.tools.testbed_cli import main

    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["slurm", "down", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ")
    assert (tmp_path / "precious.txt").read_text() == "keep me"
