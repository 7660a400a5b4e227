"""The elastic scenarios tests/test_elastic.py runs on torch's c10d store and tests/test_etcd.py on etcd: a node
lost with restarts, a node lost in place (with ``back``, started again and joining in place). Each takes
``store``, extra overrides that choose the rendezvous backend."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from hybrid.tools.job_processes import start_again

from helpers.processes import Job, agent_of_node, all_gone, descendants, job_env

__all__ = ["a_node_killed_in_place", "a_node_killed_restart"]


def a_node_killed_restart(nproc: int, comm: str, lost: int, tmp_path: Path, store: tuple[str, ...] = ()) -> None:
    """3 nodes, cluster.min_nnodes=2: node ``lost``'s agent and its workers are SIGKILLed after the step-10
    checkpoint. The other two re-rendezvous, rebuild their groups over two nodes, resume from the last checkpoint
    on the smaller world and finish every step with identical replicas."""
    import json
    import os
    import signal
    import time

    # No cluster.max_restarts: an elastic job gets one restart per node it may lose.
    job = Job(tmp_path, "cluster.nnodes=3", f"cluster.nproc_per_node={nproc}", "cluster.min_nnodes=2",
              "cluster.rdzv_last_call_s=2", f"comm={comm}", "comm.timeout_s=60", *store,
              *(["comm.sync_every=4"] if comm == "diloco" else []),
              "trainer.max_steps=30", "trainer.checkpoint_every=5", "trainer.log_every=1", "model.width=512",
              "data.num_samples=2048", f"data.root={tmp_path / 'data'}", "hydra.run.dir=run")
    job.wait_for(r"^step 11/", timeout=180)  # rank 0 saved step 10's checkpoint before its step 11
    everything = {job.proc.pid, *descendants(job.proc.pid)}  # the store, the agents, the workers
    agent = agent_of_node(job.proc.pid, lost)
    for pid in [agent, *descendants(agent)]:
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    job.wait_for(r"^resumed from step", timeout=180)
    print(f"node {lost} killed -> training resumed on 2 nodes: {time.monotonic() - killed:.1f} s")
    everything |= set(descendants(job.proc.pid))  # the restarted workers
    code, out, _ = job.finish(timeout=300)
    assert code == 0, out[-3000:]
    assert f"node(s) {lost} lost during the run" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 30 and metrics["world_size"] == 2 * nproc and metrics["nnodes"] == 2
    assert metrics["param_checksums_identical"] and metrics["runs_as"] == comm
    history = metrics["membership"]
    assert [(m["nnodes"], m["world_size"]) for m in history] == [(3, 3 * nproc), (2, 2 * nproc)]
    assert history[1]["why"] == "elastic restart 1" and 10 <= history[1]["step"] < 30
    assert f"layout changed since the checkpoint: nnodes 3 -> 2, world size {3 * nproc} -> {2 * nproc}" in out
    if comm == "diloco":  # syncs at 4, 8 and 12..28 after the restart, and the end
        assert metrics["diloco"]["outer_steps"] == 8 and metrics["diloco"]["sync_every"] == 4
    assert all_gone(sorted(everything), within_s=15)


def a_node_killed_in_place(nproc: int, comm: str, lost: int, tmp_path: Path, store: tuple[str, ...] = (),
                           mid_run: Callable[[list[int]], None] | None = None, extra: tuple[str, ...] = (),
                           after: int = 11, steps: int = 20, back: bool = False, cpus: float | None = None) -> str:
    """3 nodes, cluster.min_nnodes=2, cluster.recovery=in_place: node ``lost``'s agent and workers are SIGKILLed
    after step ``after``. The other nodes' workers are the same processes before and after, continue from the last
    step one of them completed, finish with identical replicas, and leave no process behind. ``mid_run(pids)`` runs
    after step 5, given every process of the job (tests/test_etcd.py kills an etcd member there). ``extra``: the
    comm's own overrides. ``back``: the lost node's agent is started again once the others train on, and joins in
    place (its state from live peers, over the new group). ``cpus``: each node on the testbed with that many CPUs
    (a cgroup's quota): its steps take longer while costing the machine less, so the returning node's agent, whose
    start is not throttled, joins within fewer steps. Returns the job's output."""
    import json
    import os
    import signal
    import time

    from helpers.processes import describe_processes, forks_of, workers

    job = Job(tmp_path, "cluster.nnodes=3", f"cluster.nproc_per_node={nproc}", "cluster.min_nnodes=2",
              "cluster.recovery=in_place", f"comm={comm}", "comm.timeout_s=60", *store, *extra,
              *(["cluster.testbed.enabled=true", f"cluster.testbed.cpu_quota={cpus}"] if cpus else []),
              f"trainer.max_steps={steps}", "trainer.checkpoint_every=5", "trainer.log_every=1", "trainer.elastic_lr=scale",
              "model.width=512", "data.num_samples=2048", f"data.root={tmp_path / 'data'}", "hydra.run.dir=run")
    job.wait_for(r"^step 1/", timeout=180)
    # The process tree is read before the kill's step, not after it: on a busy machine reading /proc took long
    # enough for three more steps to complete before the kill (in place resumed at 14, seen once in CI).
    everything = [job.proc.pid, *descendants(job.proc.pid)]  # the fork server, the agents, the workers
    # The agents' fork server is a fork of the command (hybrid.runtime.forked_server), and ends with the rest.
    assert len(forks_of(job.proc.pid)) == 1, describe_processes(everything)
    before = workers(job.proc.pid)
    agent = agent_of_node(job.proc.pid, lost)
    killed = [agent, *descendants(agent)]
    if mid_run is not None:
        job.wait_for(r"^step 5/", timeout=180)
        mid_run(everything)
    job.wait_for(rf"^step {after}/", timeout=180)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    job.wait_for(r"^resumed from step \d+ of the survivors' memory", timeout=120)
    job.wait_for(r"^step \d+/", timeout=60)
    print(f"node {lost} killed -> next step on 2 nodes, in place: {time.monotonic() - start:.2f} s")
    after_kill = workers(job.proc.pid)
    assert after_kill == sorted(set(before) - set(killed)), describe_processes(before, killed, after_kill)
    again = start_again(lost, agent, 3 * nproc, testbed_of=job.proc.pid if cpus else None, base_env=job_env()) if back \
        else None
    try:
        if again is not None:
            job.wait_for(r"^resumed from step \d+ of the survivors' memory", timeout=120)
            kept = sorted(set(workers(job.proc.pid)) & set(after_kill))
            assert kept == after_kill, describe_processes(after_kill, [], kept)  # the join restarted no survivor
        code, out, _ = job.finish(timeout=300)
        if again is not None:
            assert again.wait(timeout=60) == 0
    finally:
        if again is not None:
            again.kill()
    assert code == 0, out[-3000:]
    assert "restart 1" not in out and "resuming from the last checkpoint" not in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    nodes = 3 if back else 2
    assert metrics["steps"] == steps and metrics["world_size"] == nodes * nproc and metrics["nnodes"] == nodes
    assert metrics["param_checksums_identical"]
    history = metrics["membership"]
    assert [(m["nnodes"], m["world_size"], m["why"]) for m in history] == [
        (3, 3 * nproc, "start"), (2, 2 * nproc, f"in place: node(s) [{lost}] lost"),
        *([(3, 3 * nproc, f"in place: node(s) [{lost}] joined")] if back else [])], (history, out[-3000:])
    # Nothing completed is lost, at most the step in flight: the survivors continue from the last step rank 0
    # printed before the recovery (or the one after it, where the kill landed between a step's end and its line).
    # Read from the whole output, not from when this test saw the step: a starved test reads its pipe late.
    printed = [int(n) for n in re.findall(r"^step (\d+)/", out.split("resumed from step")[0], re.MULTILINE)]
    assert history[1]["step"] >= after and history[1]["step"] in (printed[-1], printed[-1] + 1), (history, printed[-3:])
    assert "learning rate scaled by 0.6667 (trainer.elastic_lr=scale)" in out
    # What moved after the loss is said in one line, as of the step the history records (survivors at that step keep
    # their own: "every rank kept its own, 0 bytes moved"; one that failed a step earlier receives the step's state).
    said = re.findall(r"^in place: state as of step (\d+) \(most advanced: rank \d+\); (.+)$", out, re.MULTILINE)
    assert said and int(said[0][0]) == history[1]["step"], (said, history)
    assert all_gone([*everything, *([again.pid] if again is not None else [])], within_s=15)
    return out
