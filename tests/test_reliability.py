"""Faults injected for real: killed workers, a link taken down, a full disk, corrupt checkpoints,
diverged replicas, non-finite gradients, and what a local job exposes on the network."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid.app.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from hybrid.core.topology import Layout
from hybrid.runtime.launch import launch_local
from hybrid.runtime.testbed import testbed_available

from helpers import reliability_targets
from helpers.processes import Job, all_gone, descendants, workers

IS_ROOT = os.geteuid() == 0
TESTBED = testbed_available()
# Steps of ~50-150 ms on this machine, so a fault lands mid-run.
SLOW = ["model.width=768", "model.depth=3", "data.num_samples=2048", "trainer.log_every=1"]


# ---------------------------------------------------------------- processes


# ---------------------------------------------------------------- checkpoints


@contextmanager
def small_tmpfs(mount: Path, size: str):
    """A file system of ``size`` (tmpfs, needs root) at ``mount``, unmounted afterwards."""
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.unit
def test_checkpoints_keep_k_and_resume_skips_truncated_corrupt_and_foreign_files(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        save_checkpoint(directory, {"w": torch.full((256,), float(step)), "step": step}, step, keep=3)
    assert sorted(p.name for p in directory.glob("step-*.pt")) == [
        "step-00000004.pt", "step-00000006.pt", "step-00000008.pt"]
    assert not [p for p in directory.iterdir() if ".tmp" in p.name]
    assert load_checkpoint(tmp_path)["step"] == 8
    # last.pt is the newest step under another name: truncating it truncates that checkpoint.
    last = directory / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    messages: list[str] = []
    assert load_checkpoint(tmp_path, log=messages.append)["step"] == 6
    assert "step-00000008.pt" in messages[0] and "truncated" in messages[0]
    # One flipped bit is caught by the recorded sha256.
    six = directory / "step-00000006.pt"
    data = bytearray(six.read_bytes())
    data[len(data) // 2] ^= 0x10
    six.write_bytes(bytes(data))
    assert "sha256" in verify_checkpoint(six)
    # A file that unpickles arbitrary objects is refused by weights_only=True.
    four = directory / "step-00000004.pt"
    torch.save({"step": 4, "evil": Path("/")}, four)
    (directory / "step-00000004.json").unlink()  # no manifest to compare: torch.load must refuse it
    messages.clear()
    with pytest.raises(ValueError, match="no usable checkpoint"):
        load_checkpoint(tmp_path, log=messages.append)
    assert len(messages) == 3 and "cannot be read" in messages[2]


@pytest.mark.multiprocess
@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as mount:
        directory = mount / "checkpoints"
        save_checkpoint(directory, {"w": torch.zeros(64 * 1024)}, 1)  # 256 KiB: fits
        before = (directory / "step-00000001.pt").read_bytes()
        with pytest.raises(CheckpointError, match=r"step 2 .*No space left on device.*step-00000001.pt\) is intact"):
            save_checkpoint(directory, {"w": torch.zeros(512 * 1024)}, 2)  # 2 MiB: cannot fit
        assert sorted(p.name for p in directory.iterdir()) == [
            "last.json", "last.pt", "step-00000001.json", "step-00000001.pt"]  # no half-written leftovers
        assert (directory / "step-00000001.pt").read_bytes() == before
        assert verify_checkpoint(directory / "last.pt") is None
        assert torch.equal(load_checkpoint(mount)["w"], torch.zeros(64 * 1024))


@pytest.mark.multiprocess
@pytest.mark.skipif(not IS_ROOT, reason="mounting a small tmpfs needs root")
def test_training_into_a_full_disk_stops_with_a_clear_error(tmp_path):
    with small_tmpfs(tmp_path / "small", "4m") as mount:
        # Only the checkpoints live on the small disk, so the write that fills it is a checkpoint's, whatever
        # order rank 0 writes its logs, TensorBoard events and checkpoints in.
        run = tmp_path / "run"
        run.mkdir()
        (run / "checkpoints").symlink_to(mount, target_is_directory=True)
        # 1.7 MB of weights + momentum per checkpoint: two fit in 4 MiB, a third does not.
        out = subprocess.run(
            [sys.executable, "-m", "hybrid.train", "cluster=1x2", "model.width=256", "model.depth=4",
             "data.num_samples=1024",
             "trainer.max_steps=40", "trainer.checkpoint_every=2", f"hydra.run.dir={run}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert out.returncode != 0
        assert re.search(r"No space left on device; the previous checkpoint \(step-\d+\.pt\) is intact",
                         out.stdout + out.stderr), out.stderr[:3000] + "\n...\n" + out.stderr[-3000:]
        good = load_checkpoint(run)
        assert good["step"] >= 2 and verify_checkpoint(run / "checkpoints" / "last.pt") is None


@pytest.mark.multiprocess
@pytest.mark.background  # mostly waits: beside the first tiers
def test_resume_from_a_corrupt_newest_checkpoint_uses_the_one_before(tmp_path):
    run = tmp_path / "run"
    # One node of two workers: what is tested is the checkpoint files, not the layout (and it starts faster).
    common = ["cluster=1x2", "model.width=32", "data.num_samples=512", "trainer.checkpoint_every=2"]
    first = subprocess.run([sys.executable, "-m", "hybrid.train", *common, "trainer.max_steps=6",
                            f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    last = run / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:-100])  # the end of the newest checkpoint is lost
    again = subprocess.run([sys.executable, "-m", "hybrid.train", *common, "trainer.max_steps=8",
                            "trainer.resume=true", f"hydra.run.dir={run}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step-00000006.pt' is unusable (truncated" in again.stdout
    assert "resumed from step 4" in again.stdout
    assert json.loads((run / "metrics.json").read_text())["steps"] == 8


# ---------------------------------------------------------------- peer failure, restarts


@pytest.mark.multiprocess
@pytest.mark.background  # mostly waits: beside the first tiers
def test_a_killed_worker_stops_the_whole_job_with_its_rank_named(tmp_path):
    job = Job(tmp_path, *SLOW, "trainer.max_steps=100000", "comm.timeout_s=20", "comm=hierarchical")
    job.wait_for(r"step 5/")
    everyone = descendants(job.proc.pid)
    victim = workers(job.proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    code, output, elapsed = job.finish(timeout=20 + 60)
    assert code != 0
    # The cause comes first: that process, its rank, the signal.
    cause = output[output.index("failed:"):]
    assert re.search(rf"rank\s*:\s*\d \(local_rank: \d\)\s+exitcode\s*:\s*-9 \(pid: {victim}\)", cause), output[-3000:]
    assert "SIGKILL" in cause
    assert elapsed < 20 + 30  # comm.timeout_s plus a few seconds at most
    assert all_gone(everyone)  # no agent or worker left behind


@pytest.mark.testbed
@pytest.mark.skipif(TESTBED is not None, reason=f"testbed unavailable: {TESTBED}")
@pytest.mark.background  # mostly waits (comm.timeout_s on the downed link)
def test_a_node_whose_link_goes_down_fails_the_job_within_the_timeout(tmp_path):
    timeout_s = 10  # also start-up's limit (store, groups): leave a loaded machine room (the testbed link-down run takes 8)
    job = Job(tmp_path, *SLOW, "trainer.max_steps=100000", f"comm.timeout_s={timeout_s}", "comm=hierarchical",
              "cluster.nnodes=2", "cluster.nproc_per_node=1", "cluster.testbed.enabled=true",
              "cluster.testbed.link_mbit=1000")
    job.wait_for(r"step 5/")
    everyone = descendants(job.proc.pid)
    namespace = f"hybrid-{job.proc.pid}-n1"
    subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "nic0", "down"], check=True)
    code, output, elapsed = job.finish(timeout=timeout_s + 90)
    assert code != 0
    # Rank 0 (node 0) waits on rank 1 until its collective times out, and says where it was.
    assert re.search(r"failed on rank 0 \(node 0.*after \d+\.\ds", output), output[-3000:]
    assert elapsed < timeout_s + 45
    assert all_gone(everyone)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hybrid-{job.proc.pid}-" not in netns  # the testbed is gone too


@pytest.mark.multiprocess
@pytest.mark.background  # mostly waits: beside the first tiers
def test_elastic_restart_resumes_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    common = [*SLOW, "trainer.max_steps=16", "trainer.checkpoint_every=5", "comm=sharded"]
    clean = subprocess.run([sys.executable, "-m", "hybrid.train", *common, f"hydra.run.dir={tmp_path / 'clean'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    job = Job(tmp_path, *common, "cluster.max_restarts=1", f"hydra.run.dir={tmp_path / 'faulty'}")
    job.wait_for(r"step 7/")
    os.kill(workers(job.proc.pid)[-1], signal.SIGKILL)
    code, output, _ = job.finish(timeout=300)
    assert code == 0, output[-3000:]
    # From step 5's checkpoint, or a later one where the kill landed late (a loaded machine).
    resumed = re.search(r"resumed from step (\d+)", output)
    assert "restart 1: resuming" in output and resumed and int(resumed.group(1)) in (5, 10, 15), output[-3000:]
    want = json.loads((tmp_path / "clean" / "metrics.json").read_text())
    got = json.loads((tmp_path / "faulty" / "metrics.json").read_text())
    assert got["steps"] == want["steps"] == 16
    assert got["param_checksum"] == want["param_checksum"]  # bit-identical final parameters


@pytest.mark.multiprocess
@pytest.mark.background  # mostly waits: beside the first tiers
def test_losing_the_single_rendezvous_store_ends_the_job_in_one_line_per_node_and_resume_finishes_it(tmp_path):
    """2x1 elastic in place, its one c10d store (a process of its own) SIGKILLed after step 11: every process
    exits within comm.timeout_s + 10 s, each agent and worker says so in one line that names the store (no
    traceback, no C++ stack), the launcher exits 75 naming the last checkpoint, and trainer.resume=true
    finishes the run from it."""
    import time

    timeout_s, steps = 20, 60  # steps: room for a busy machine, whose test process reads the job's lines late
    common = [*SLOW, "cluster.nnodes=2", "cluster.nproc_per_node=1", "cluster.min_nnodes=1", "cluster.recovery=in_place",
              "comm=hierarchical", f"comm.timeout_s={timeout_s}", f"trainer.max_steps={steps}", "trainer.checkpoint_every=5",
              f"hydra.run.dir={tmp_path / 'run'}"]
    job = Job(tmp_path, *common)
    # The process tree is read before step 11, not after it: on a busy machine reading /proc took long enough
    # for the run to end before the kill.
    job.wait_for(r"^step 1/")
    everyone = descendants(job.proc.pid)
    store = [p for p in everyone if b"hybrid.runtime.rdzv_store" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(store) == 1, store
    job.wait_for(r"^step 11/")
    os.kill(store[0], signal.SIGKILL)
    killed = time.monotonic()
    code, output, _ = job.finish(timeout=timeout_s + 60)
    assert all_gone(everyone, within_s=max(0.0, timeout_s + 10 - (time.monotonic() - killed)))
    assert code == 75, output[-3000:]
    # Not anchored at a line's start: the processes print into one pipe at once, so a line may begin right
    # after another's text, before its newline.
    said = re.findall(r"(hybrid agent: node \d|worker \d\.\d): lost the rendezvous store at 127\.0\.0\.1:\d+ ", output)
    assert sorted(set(said)) == sorted(said) and {"hybrid agent: node 0", "hybrid agent: node 1"} <= set(said), (
        said, output[-4000:])
    assert "Traceback" not in output and "frame #" not in output, output[-3000:]
    last = int(re.search(r"its last checkpoint \(step (\d+)\)", output).group(1))
    assert 10 <= last < steps
    again = subprocess.run([sys.executable, "-m", "hybrid.train", *common, "trainer.resume=true"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step {last}" in again.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == steps


# ---------------------------------------------------------------- guards


@pytest.mark.multiprocess
def test_replica_divergence_is_caught_on_every_rank_naming_the_diverged_one():
    messages = launch_local(Layout.parse("2x2"), reliability_targets.diverge_and_check, (2,), timeout_s=120)
    assert len(messages) == 4
    for message in messages:
        assert message.startswith("step 2: replicas diverged: rank(s) [2] hold parameters different from "
                                   "rank(s) [0, 1, 3]"), message


def _files_with_a_nan(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    x[37, 5] = np.nan  # one bad sample: its batch's loss and then every rank's averaged gradient are NaN
    y = rng.integers(0, 10, 256).astype(np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return ["cluster=1x2", "data=files", f"data.inputs={tmp_path / 'x.npy'}", f"data.targets={tmp_path / 'y.npy'}",
            "data.features=16", "model.width=32", "data.batch_size=16", "trainer.max_steps=12"]


@pytest.mark.multiprocess
def test_non_finite_gradients_stop_the_run_by_default(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybrid.train", *_files_with_a_nan(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert re.search(r"step \d+: non-finite \(inf/NaN\) gradients after averaging over all ranks; stopping",
                     out.stdout + out.stderr)


@pytest.mark.multiprocess
def test_non_finite_gradients_can_be_skipped(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybrid.train", *_files_with_a_nan(tmp_path),
                          "trainer.nonfinite_grads=skip", "trainer.check_replicas_every=4",
                          f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["skipped_steps"] >= 1 and "non-finite gradients, step skipped" in out.stdout
    assert metrics["param_checksums_identical"]
    state = load_checkpoint(tmp_path / "run")
    assert all(torch.isfinite(v).all() for v in state["model"].values())


# ---------------------------------------------------------------- exposure


@pytest.mark.multiprocess
def test_a_local_job_listens_on_loopback_only():
    results = launch_local(Layout.parse("2x2"), reliability_targets.listening_sockets, (), timeout_s=120)
    sockets = [s for r in results for s in r["listening"]]
    assert sockets, "found no listening socket at all: the check would be vacuous"
    assert [s for s in sockets if not s["loopback"]] == []
