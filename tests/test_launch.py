"""hybrid.runtime.launch: torchrun's environment per rank, errors surfaced, hung jobs stopped."""

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hybrid.core.topology import Layout
from hybrid.runtime.launch import LaunchError, launch_local

from helpers import background, launch_targets
from helpers.processes import hybrid_processes, left_after, processes_with_marker


@pytest.mark.multiprocess
def test_uneven_layout_gets_honest_torchrun_environment():
    envs = launch_local(Layout.parse("2,1"), launch_targets.report_env, timeout_s=120)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    by_node: dict[str, list[dict]] = {}
    for e in envs:
        by_node.setdefault(e["GROUP_RANK"], []).append(e)
    assert sorted(len(v) for v in by_node.values()) == [1, 2]
    for members in by_node.values():
        assert sorted(m["LOCAL_RANK"] for m in members) == [str(i) for i in range(len(members))]
        assert {m["LOCAL_WORLD_SIZE"] for m in members} == {str(len(members))}
    assert {e["GLOO_SOCKET_IFNAME"] for e in envs} == {"lo"}
    # torch's agent keeps its workers' error files in the job's folder, which the launch removes, not in a
    # torchelastic_* folder of its own left in the temp dir by every launch.
    folders = {str(p) for e in envs for p in Path(e["TORCHELASTIC_ERROR_FILE"]).parents
               if p.name.startswith("hybrid-job-")}
    assert len(folders) == 1 and not Path(folders.pop()).exists(), [e["TORCHELASTIC_ERROR_FILE"] for e in envs]


@pytest.mark.multiprocess
def test_a_process_that_ran_a_torch_op_gets_a_fresh_interpreter_as_its_agents_fork_server():
    """The agents' fork server is a fork of the command only while that is safe (hybrid.runtime.forked_server):
    once a torch op has started the intra-op thread pool, a fork's workers could wait on that pool forever, so
    the server is multiprocessing's usual fresh interpreter (the elastic scenarios check the forked case)."""
    code = ("import torch; from multiprocessing import forkserver\n"
            "from hybrid.runtime.launch import start_agent_server\n"
            "torch.set_num_threads(2); (torch.randn(512, 512) @ torch.randn(512, 512)).sum()\n"
            "start_agent_server(print, fork_this_process=True)\n"
            # Read until the server's exec has set its command line (empty while the kernel replaces its image).
            "import time; deadline = time.monotonic() + 30\n"
            "while not (line := open(f'/proc/{forkserver._forkserver._forkserver_pid}/cmdline').read()) "
            "and time.monotonic() < deadline: time.sleep(0.01)\n"
            "print(line.replace(chr(0), ' '))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "from multiprocessing.forkserver import main" in done.stdout, done.stdout


@pytest.mark.unit
def test_an_agents_rendezvous_events_get_the_names_torchs_own_lookup_gives(monkeypatch):
    """hybrid's agents name torch's rendezvous events from the frame, not by reading every frame's source
    (hybrid.runtime.agent.name_rendezvous_events_cheaply): the names stay the ones torch's lookup gives."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from hybrid.runtime import agent

    torchs = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # put back after the test

    def _record(name_of, depth):  # as torch's _record asks: the method that called _record
        return name_of(depth) if depth is not None else name_of()

    def _keep_alive(name_of, depth=None):
        return _record(name_of, depth)

    agent.name_rendezvous_events_cheaply()
    assert dynamic_rendezvous.get_method_name is not torchs
    for depth in (None, 1, 3, 10_000):
        assert _keep_alive(dynamic_rendezvous.get_method_name, depth) == _keep_alive(torchs, depth)
    assert _keep_alive(dynamic_rendezvous.get_method_name) == "_keep_alive"


@pytest.mark.multiprocess
def test_worker_exception_is_surfaced_with_its_message():
    with pytest.raises(LaunchError, match="boom-42"):
        launch_local(Layout.parse("1x2"), launch_targets.fail_on_rank_one, timeout_s=120)


@pytest.mark.multiprocess
@pytest.mark.after_background
def test_hung_job_is_stopped_at_the_deadline_and_leaves_no_process():
    background.wait_all()  # it looks at every hybrid process on the machine: none of another test's may run
    marker = uuid.uuid4().hex
    with pytest.raises(LaunchError, match="did not finish within timeout_s=6"):
        launch_local(
            Layout.parse("2x1"), launch_targets.block_forever, timeout_s=6,
            env={"HYBRID_TEST_MARKER": marker},
        )
    # Started with the marker (an agent in a namespace), or named as hybrid names its agents and workers
    # (a forked one shows its fork server's environment and command line).
    assert left_after(lambda: processes_with_marker(marker) + hybrid_processes(), within_s=10) == []


@pytest.mark.unit
def test_bad_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_s=0"):
        launch_local(Layout.parse("1x1"), launch_targets.report_env, timeout_s=0)


class _ExitsWhileLooked:
    """An agent process that is still running at the launcher's first look and has exited at the next, the
    interleaving that ended a 15-run benchmark with StopIteration after its last step (the launcher asked
    for "an agent still running" after every agent had exited)."""

    def __init__(self) -> None:
        self.looks = 0

    def poll(self) -> int | None:
        self.looks += 1
        return None if self.looks == 1 else 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.mark.unit
def test_agents_that_exit_between_two_looks_end_the_wait():
    from hybrid.runtime.launch import _wait

    agents = [_ExitsWhileLooked(), _ExitsWhileLooked()]
    _wait(agents, Layout.uniform(2, 1), timeout_s=5)  # returns, no StopIteration
    assert all(a.looks >= 2 for a in agents)


@pytest.mark.unit
def test_an_elastic_job_succeeds_only_with_every_rank_of_its_last_membership(tmp_path, capsys):
    """Node 2 lost: the results of nodes 0 and 1 are the job's if they cover ranks 0..n-1; without rank 0's
    (a survivor stopped late, say) the job fails, naming the lost node."""
    import pickle
    from types import SimpleNamespace

    from hybrid.runtime.launch import LaunchError, _collect

    agents = [SimpleNamespace(returncode=0), SimpleNamespace(returncode=0), SimpleNamespace(returncode=-9)]
    for node, ranks in ((0, {0: "a"}), (1, {1: "b"})):
        (tmp_path / f"result-{node}.pkl").write_bytes(pickle.dumps(("ok", ranks)))
    assert _collect(tmp_path, agents, min_nnodes=2) == ["a", "b"]
    assert "node(s) 2 lost during the run" in capsys.readouterr().err
    with pytest.raises(LaunchError, match="node 2 failed"):
        _collect(tmp_path, agents, min_nnodes=None)  # not elastic: a lost node fails the job
    (tmp_path / "result-0.pkl").write_bytes(pickle.dumps(("ok", {})))
    with pytest.raises(LaunchError, match="node 2 failed"):
        _collect(tmp_path, agents, min_nnodes=2)  # rank 0 missing


@pytest.mark.multiprocess
def test_the_rendezvous_store_off_the_nodes_serves_clients_and_ends_with_its_launcher():
    """hybrid.runtime.rdzv_store: torch's TCPStore in a process of its own (an elastic job's rendezvous, so that
    no node hosts it); clients read and write it; a job given it as its endpoint (cluster.rdzv_endpoint) meets
    there, every agent a client (the rendezvous' keys are in it afterwards); it exits when its launcher closes the
    pipe (or dies: the same end of file), and a port already taken is refused in one line."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from hybrid.runtime.rdzv_store import start_store

    store = start_store("127.0.0.1", 0)
    host, port = store.endpoint.split(":")
    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    client.set("membership", "0,1,2")
    assert TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)).get("membership") == b"0,1,2"
    before = client.num_keys()
    envs = launch_local(Layout.parse("2x1"), launch_targets.report_env, timeout_s=120, rdzv_endpoint=store.endpoint)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert client.num_keys() > before  # the agents' rendezvous state lives in this store
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match=r"the rendezvous store on 127\.0\.0\.1:\d+ did not start: "):
            start_store("127.0.0.1", taken.getsockname()[1], timeout_s=20)
    store.process.stdin.close()  # what the launcher's exit does to it
    assert store.process.wait(timeout=10) == 0
