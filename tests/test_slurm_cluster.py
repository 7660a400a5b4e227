"""The slurm tier: hydra/launcher=slurm on a real Slurm cluster (slurmctld, one slurmd per testbed node).

One cluster for the whole module (``python -m hybrid.testbed slurm up --nodes 3``, as a user starts it), and
three sweeps on it, each checked against what Slurm itself recorded: sizes 1, 2 and 3; a requeued job
(bitwise against the first sweep's uninterrupted one) beside a cancelled one; a node lost under an elastic
job. Runs with ``pytest --slurm -m slurm`` (``.ci/run`` after the suite); needs root and Debian's Slurm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.runtime.slurm_cluster import slurm_missing

pytestmark = pytest.mark.slurm

if slurm_missing() is not None:
    pytest.skip(slurm_missing(), allow_module_level=True)

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[test]' brings it")

import torch  # noqa: E402

NODES = 3
# 100 steps: long enough that a requeue after the step-10 checkpoint lands mid-run, short for the tier.
JOB = ["cluster.nproc_per_node=1", "model.width=64", "model.depth=2", "trainer.max_steps=100",
       "trainer.checkpoint_every=10", "data.num_samples=2048", "comm.timeout_s=30", "cluster.launch_timeout_s=90",
       "hydra.launcher.timeout_min=5"]
SWEEP_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 3-node Slurm testbed; its folder under /run (munged, as the munge user, must reach its socket)."""
    folder = Path(f"/run/hybrid-slurm-tier-{os.getpid()}")
    up = subprocess.run([sys.executable, "-m", "hybrid.testbed", "slurm", "up", "--nodes", str(NODES), "--cores", "2",
                         "--dir", str(folder)], capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    export = up.stdout.strip().splitlines()[-1]
    assert export == f"export SLURM_CONF={folder / 'slurm.conf'}", up.stdout
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    work = tmp_path_factory.mktemp("slurm")
    yield {"folder": folder, "env": env, "work": work, "holder": int((folder / "holder.pid").read_text())}
    subprocess.run([sys.executable, "-m", "hybrid.testbed", "slurm", "down", "--dir", str(folder)],
                   capture_output=True, text=True, timeout=120)


def slurm(cluster, *cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=cluster["env"], timeout=60)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
    return done.stdout


def sweep(cluster, name: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybrid.train", "-m", "hydra/launcher=slurm", *JOB, *overrides,
                             f"hydra.sweep.dir={cluster['work'] / name}"], cwd=cluster["work"], env=cluster["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the sweep did not end within {SWEEP_TIMEOUT_S} s: {out[-3000:]}")
    return proc.returncode, out


def wait_for(path_glob: Path, within_s: float = 120) -> Path:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = sorted(path_glob.parent.glob(path_glob.name)) if "*" in path_glob.name else (
            [path_glob] if path_glob.exists() else [])
        if found:
            return found[0]
        time.sleep(0.1)
    pytest.fail(f"{path_glob} did not appear within {within_s} s")


def job_dir(root: Path, *parts: str) -> Path:
    (found,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and all(x in p.name for x in parts)]
    return found


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=False)["model"]


@pytest.fixture(scope="module")
def sizes(cluster):
    """The sweep users run: one job per cluster size, each its own Slurm job with its own node count."""
    # Sizes 1 and 2 at once on the 3 nodes (the elastic test below starts a 3-node job).
    code, out = finish(sweep(cluster, "sizes", "cluster.nnodes=1,2", "comm=hierarchical"))
    assert code == 0, out[-4000:]
    return cluster["work"] / "sizes", out


def test_sweep_across_sizes_runs_as_slurm_jobs_on_distinct_hosts(cluster, sizes):
    root, _ = sizes
    for n in (1, 2):
        run = job_dir(root, f"cluster.nnodes:{n}")
        metrics = json.loads((run / "metrics.json").read_text())
        assert (metrics["nnodes"], metrics["world_size"], metrics["steps"]) == (n, n, 100)
        assert metrics["param_checksums_identical"]
        # Each node on a host of its own, named by Slurm (the testbed's node namespaces).
        assert len(set(metrics["node_hosts"])) == n and all(h.startswith("hybrid-n") for h in metrics["node_hosts"])
        outcome = json.loads((run / "slurm.json").read_text())
        assert outcome["state"] == "COMPLETED" and outcome["requeued"] == 0
        record = slurm(cluster, "scontrol", "show", "job", "--oneliner", outcome["job_id"])
        assert "JobState=COMPLETED" in record and f"NumNodes={n} " in record, record
        assert sorted(metrics["node_hosts"]) == sorted(slurm(cluster, "scontrol", "show", "hostnames",
                                                        outcome["nodes"]).split())
    assert slurm(cluster, "squeue", "-h").strip() == ""
    report = subprocess.run([sys.executable, "-m", "hybrid.report", str(root)], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0 and "2/2 jobs finished" in report.stdout, report.stderr[-2000:]
    assert (root / "report.md").is_file()


def queued(cluster, count: int) -> dict[str, str]:
    """The queued jobs' ids by node count, once there are ``count`` of them."""
    deadline = time.monotonic() + 120
    while len(by_size := dict(reversed(line.split()) for line in
                              slurm(cluster, "squeue", "-h", "-o", "%i %D").splitlines())) < count:
        assert time.monotonic() < deadline, f"{count} jobs were not queued within 120 s"
        time.sleep(0.2)
    return by_size


def test_requeued_job_resumes_bitwise_and_a_cancelled_one_is_reported(cluster, sizes):
    """scontrol requeue after a checkpoint mid-run: the same weights as the uninterrupted 2-node job of the
    first sweep, in one run dir; scancel of the other job of the sweep: reported CANCELLED, the first unaffected.
    Beside them a 1-node job gets Slurm's warning signal (as before a time limit): it stops at an agreed step
    with a checkpoint there, requeues itself and ends with the uninterrupted 1-node job's weights."""
    root, warned = cluster["work"] / "requeue", cluster["work"] / "warned"
    proc = sweep(cluster, "requeue", "cluster.nnodes=2,1", "comm=hierarchical")
    by_size = queued(cluster, 2)
    slurm(cluster, "scancel", by_size["1"])  # at once: it must not finish first
    signalled = sweep(cluster, "warned", "cluster.nnodes=1", "comm=hierarchical")  # on the node the cancel freed
    hier = root / "00_cluster.nnodes:2"
    single = wait_for(warned / "00_*")
    # Each job, once it has a checkpoint (both run at once; whichever gets there first is interrupted first).
    pending = {"requeue": (hier, ["scontrol", "requeue", by_size["2"]]), "signal": (single, None)}
    deadline = time.monotonic() + 120
    while pending:
        assert time.monotonic() < deadline, f"no checkpoint within 120 s for {sorted(pending)}"
        for what, (run, cmd) in list(pending.items()):
            if list((run / "checkpoints").glob("step-*.pt")):
                slurm(cluster, *(cmd or ["scancel", "--signal=USR2", queued(cluster, 2)["1"]]))
                del pending[what]
        time.sleep(0.05)
    code, out = finish(proc)
    assert code != 0 and f"Slurm job {by_size['1']} ended CANCELLED" in out, out[-4000:]

    code, out = finish(signalled)
    assert code == 0, out[-4000:]
    stopped = json.loads((single / "stopped.json").read_text())["step"]
    log = (single / "train.log").read_text()
    assert f"stopped after step {stopped} for Slurm" in log and f"resumed from step {stopped} of" in log, log[-3000:]
    assert json.loads((single / "slurm.json").read_text())["requeued"] == 1
    mine, straight = weights(single), weights(job_dir(sizes[0], "cluster.nnodes:1"))
    assert all(torch.equal(mine[k], straight[k]) for k in straight)

    outcome = json.loads((hier / "slurm.json").read_text())
    assert (outcome["state"], outcome["requeued"]) == ("COMPLETED", 1)
    assert "Slurm requeue 1: resuming from the last checkpoint" in (hier / "train.log").read_text()
    assert re.search(r"resumed from step [1-9]0 of", (hier / "train.log").read_text())  # mid-run
    mine, straight = weights(hier), weights(job_dir(sizes[0], "cluster.nnodes:2"))
    assert mine.keys() == straight.keys() and all(torch.equal(mine[k], straight[k]) for k in mine)
    assert json.loads((hier / "metrics.json").read_text())["steps"] == 100
    assert len([p for p in root.iterdir() if p.name.startswith("00_")]) == 1  # one run dir

    cancelled = json.loads((root / "01_cluster.nnodes:1" / "slurm.json").read_text())
    assert cancelled["state"] == "CANCELLED"
    report = subprocess.run([sys.executable, "-m", "hybrid.report", str(root)], capture_output=True, text=True,
                            timeout=120)
    assert f"(Slurm job {by_size['1']}: CANCELLED)" in report.stdout, report.stdout[-2000:]
    assert "requeued 1x" not in report.stdout  # a job that finished is not among those without metrics


def test_elastic_job_goes_on_when_a_node_is_lost(cluster, sizes):
    """Node 2's slurmd and tasks SIGKILLed after the step-10 checkpoint, the node set DOWN: the job finishes on
    the other two with identical replicas. Last: node 2 stays down."""
    root = cluster["work"] / "lost"
    proc = sweep(cluster, "lost", f"cluster.nnodes={NODES}", "cluster.min_nnodes=2", "cluster.rdzv_last_call_s=2",
                  "comm=hierarchical")
    run = wait_for(root / "00_*")
    wait_for(run / "checkpoints" / "step-*.pt")
    namespace = f"hybrid-{cluster['holder']}-n{NODES - 1}"
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout.split()
    assert pids, f"no process in {namespace}"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    slurm(cluster, "scontrol", "update", f"NodeName=hybrid-n{NODES - 1}", "State=DOWN", "Reason=killed-by-test")
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["nnodes"], metrics["steps"]) == (2, 100) and metrics["param_checksums_identical"]
    assert sorted(metrics["node_hosts"]) == ["hybrid-n0", "hybrid-n1"]
    assert "elastic restart 1: resuming from the last checkpoint" in (run / "train.log").read_text()


def test_down_leaves_nothing(cluster):
    folder = cluster["folder"]
    down = subprocess.run([sys.executable, "-m", "hybrid.testbed", "slurm", "down", "--dir", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not folder.exists()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert f"hybrid-{cluster['holder']}-" not in names
    ps = subprocess.run(["ps", "-eo", "comm"], capture_output=True, text=True, timeout=30).stdout.split()
    assert not {"slurmd", "slurmctld", "slurmstepd"} & set(ps)
