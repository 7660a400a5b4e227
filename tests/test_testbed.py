"""The network testbed: namespaces on shaped links, really shaping, always cleaned up.

Needs root and iproute2 (CI here has both); elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from hybrid.core.topology import Layout
from hybrid.runtime.launch import launch_local
from hybrid.runtime.testbed import LinkShape, Testbed, cleanup_leftovers, nic_address, process_alive, testbed_available
from hybrid.tools import testbed_cli

from helpers import as_user, testbed_targets
from helpers.elastic_scenarios import a_node_killed_in_place

REASON = testbed_available()
needs_testbed = pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")


def ours(owner: int | None = None) -> list[str]:
    """hybrid's network namespaces on this machine: those made by process ``owner``, or, with none given, every one
    whose maker has exited (a leftover). A testbed that a job of the background lane holds meanwhile is neither."""
    if REASON is not None and "root" in REASON:
        return []  # cannot list or create namespaces without root; nothing of ours can exist
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith("hybrid-")]
    if owner is not None:
        return [name for name in names if name.startswith(f"hybrid-{owner}-")]
    return [name for name in names if _left_over(name)]


def left_by_exited_makers(folder: Path) -> list[str]:
    """The testbed entries in ``folder`` (a hosts folder, a cgroup) whose maker has exited. Those of a testbed still
    held (a job of the background lane, a Slurm testbed up meanwhile) are not."""
    return sorted(p.name for p in folder.glob("hybrid-*") if _left_over(p.name))


def _left_over(name: str) -> bool:
    """Whether testbed entry ``name`` (``hybrid-PID-...``, named for the process that made it) outlived its maker."""
    pid = name.split("-")[1]
    return pid.isdigit() and not process_alive(int(pid))


@pytest.mark.testbed
@needs_testbed
def test_nodes_are_separate_namespaces_and_the_link_is_really_shaped():
    link_mbit, nbytes, repeats = 100.0, 4 * 2**20, 3
    with Testbed(2, LinkShape(link_mbit)) as bed:
        assert sorted(ours(os.getpid())) == sorted([*bed.namespaces, bed.service_namespace])
        results = launch_local(Layout.parse("2x1"), testbed_targets.timed_allreduce, (nbytes, repeats),
                               timeout_s=180, nodes=bed.nodes)
    assert ours(os.getpid()) == []
    assert {r["ifname"] for r in results} == {"nic0"}
    assert len({r["netns"] for r in results}) == 2  # each rank in its own namespace
    assert all(r["netns"] != os.readlink("/proc/self/ns/net") for r in results)
    # Entered as `ip netns exec` enters a node (hybrid.runtime.netns): the node's devices in /sys, the testbed's
    # hosts file over /etc/hosts, in a mount namespace of the node's own (the machine's /etc/hosts is untouched).
    assert all(r["sys_net"] == ["lo", "nic0"] for r in results), [r["sys_net"] for r in results]
    assert all("hybrid-n1" in r["hosts"] and r["mntns"] != os.readlink("/proc/self/ns/mnt") for r in results), results
    assert "hybrid-n1" not in Path("/etc/hosts").read_text()
    # A 2-rank ring all-reduce sends S bytes each way through each NIC: at 100 Mbit/s
    # that cannot take less than S / rate. On loopback it takes a few ms.
    floor = repeats * nbytes * 8 / (link_mbit * 1e6)
    assert min(r["seconds"] for r in results) > 0.8 * floor


@pytest.mark.testbed
@needs_testbed
def test_bench_counts_the_bytes_crossing_each_nic_and_the_link_caps_utilisation(tmp_path):
    """2 nodes x 2 workers, 2 MiB: sharded's inter-node phase sends each worker's 1 MiB shard
    once each way (2 MiB per NIC); a flat ring of 4 ranks crosses each NIC with 1.5 x 2 MiB; with the
    inter-node hop in bf16, hierarchical's leader and sharded's two workers put half of 2 MiB on it."""
    size, link_mbit = 2 * 2**20, 200
    out = subprocess.run(
        [sys.executable, "-m", "hybrid.bench", "--layout", "2x2", "--sizes", "2M", "--algorithms",
         "sharded-inter,flat,hierarchical+bf16,sharded+bf16", "--iters", "3", "--warmup", "1", "--testbed-mbit", str(link_mbit),
         "--output", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "link use" in out.stdout
    rows = {r["algorithm"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    for name, payload in (("sharded-inter", size), ("flat", 1.5 * size), ("hierarchical+bf16", size / 2),
                          ("sharded+bf16", size / 2)):
        row = rows[name]
        # Headers and a few barrier messages on top of the payload, never less than it.
        assert payload <= row["nic_tx_bytes"] < 1.15 * payload, (name, row["nic_tx_bytes"])
        # The shaping caps what a NIC can move (the wire bytes include the headers tbf counts), but for tbf's
        # bucket, sent at line speed after a pause: an iteration may beat the rate by bucket / its bytes (1.057
        # was seen against a flat 1.05 for 2 MiB). 2% more for where the timed window and the counters differ.
        bound = 1.02 + LinkShape(link_mbit).bucket_kb * 1024 / row["nic_tx_bytes"]
        assert 0.2 < row["link_utilisation"] <= bound, (name, row["link_utilisation"], bound)
    assert ours() == []


def _rx_bytes(namespace: str) -> dict[str, int]:
    """Bytes each interface of ``namespace`` has received."""
    text = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/proc/net/dev"], capture_output=True,
                          text=True, check=True).stdout
    return {line.split(":")[0].strip(): int(line.split(":")[1].split()[0]) for line in text.splitlines()[2:]}


_SEND = ("import socket, sys, time\n"
         "addr, n = sys.argv[1], int(sys.argv[2])\n"
         "for attempt in range(100):\n"
         "    try:\n"
         "        s = socket.create_connection((addr, 5001), timeout=30); break\n"
         "    except OSError:\n"
         "        time.sleep(0.05)\n"
         "start = time.perf_counter(); s.sendall(b'x' * n); s.shutdown(socket.SHUT_WR); s.recv(1)\n"
         "print(time.perf_counter() - start)\n")
_RECV = ("import socket, sys\n"
         "srv = socket.create_server((sys.argv[1], 5001)); srv.settimeout(60); c, _ = srv.accept()\n"
         "while c.recv(1 << 16): pass\n"
         "c.close()\n")


def _send(bed: Testbed, src: int, dst: int, nic: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over TCP from node ``src`` to NIC ``nic`` of node ``dst``."""
    addr = nic_address(dst, nic)
    with subprocess.Popen(["ip", "netns", "exec", bed.namespaces[dst], sys.executable, "-c", _RECV, addr]) as rx:
        out = subprocess.run(["ip", "netns", "exec", bed.namespaces[src], sys.executable, "-c", _SEND, addr,
                              str(nbytes)], capture_output=True, text=True, timeout=60, check=True)
        rx.wait(timeout=30)
    return float(out.stdout)


@pytest.mark.testbed
@needs_testbed
def test_several_nics_per_node_each_its_own_shaped_rail_and_one_rate_per_node():
    """Node 0 and 1 at 100 Mbit/s, node 2 degraded to 25; two NICs each. What is sent to a NIC's address
    arrives on that NIC and no other (a multi-homed host answering ARP for every address would let one NIC
    take both rails' traffic), and the degraded node's links are shaped to its own rate."""
    nbytes = 2 * 2**20
    with Testbed(3, [LinkShape(100), LinkShape(100), LinkShape(25)], nics_per_node=2) as bed:
        assert [n.ifname for n in bed.nodes] == ["nic0,nic1"] * 3
        assert [n.address for n in bed.nodes] == [nic_address(i, 0) for i in range(3)]
        for nic in (0, 1):
            before = _rx_bytes(bed.namespaces[1])
            _send(bed, 0, 1, nic, nbytes)
            after = _rx_bytes(bed.namespaces[1])
            got = {name: after[name] - before[name] for name in ("nic0", "nic1")}
            assert got[f"nic{nic}"] >= nbytes and got[f"nic{1 - nic}"] < 0.01 * nbytes, (nic, got)
        fast = _send(bed, 0, 1, 1, nbytes)
        slow = _send(bed, 0, 2, 1, nbytes)  # into node 2: its host-side qdisc, 25 Mbit/s
    assert ours(os.getpid()) == []
    assert fast > 0.8 * nbytes * 8 / 100e6
    assert slow > 0.8 * nbytes * 8 / 25e6


@pytest.mark.testbed
@needs_testbed
def test_bench_with_two_nics_spreads_shardeds_cross_groups_over_both(tmp_path):
    """2 nodes x 2 workers, 2 NICs each, 2 MiB: sharded's two cross groups start on different NICs, so
    each NIC carries one worker's 1 MiB shard (once each way); flat's one ring uses one NIC per call."""
    size = 2 * 2**20
    out = subprocess.run(
        [sys.executable, "-m", "hybrid.bench", "--layout", "2x2", "--sizes", "2M", "--algorithms",
         "sharded-inter,flat", "--iters", "3", "--warmup", "1", "--testbed-mbit", "200", "--testbed-nics", "2",
         "--output", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MB per NIC by node" in out.stdout and "2 NIC(s) per node" in out.stdout
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["testbed_nics_per_node"] == 2
    rows = {r["algorithm"]: r for r in report["results"]}
    for node in rows["sharded-inter"]["nic_tx_bytes_by_node"]:
        assert len(node) == 2 and all(size / 2 <= b < 1.15 * size / 2 for b in node), node
    for node in rows["flat"]["nic_tx_bytes_by_node"]:  # 1.5 x S on one NIC, the other idle
        assert 1.5 * size <= max(node) < 1.15 * 1.5 * size and min(node) < 0.01 * size, node
    assert ours() == []


def _host_links() -> dict[str, str]:
    """Every link of the host's namespace: name -> its state and qdisc line, to see nothing else changed."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
    out = {}
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (maker := re.match(r"hyb(\d+)", name)) and int(maker.group(1)) != os.getpid():
            continue  # another process's testbed (a job of the background lane), made and removed meanwhile
        out[name] = " ".join(q for q in qdiscs.splitlines() if f" dev {name} " in q + " ")
    return out


@pytest.mark.testbed
@needs_testbed
def test_the_testbed_touches_only_links_it_created():
    before = _host_links()
    with Testbed(2, LinkShape(100)) as bed:
        during = _host_links()
        assert sorted(ours(os.getpid())) == sorted([*bed.namespaces, bed.service_namespace])
    after = _host_links()
    added = set(during) - set(before)
    assert added and all(name.startswith(f"hyb{os.getpid()}") for name in added), added
    assert {k: during[k] for k in before} == before  # no existing link or qdisc was changed
    assert after == before


def _rates(bed: Testbed) -> list[str]:
    """Each link's tbf rate, host end then NIC, node by node, as tc reports it."""
    out = []
    for ns, host_end in zip(bed.namespaces, (f"hyb{os.getpid()}n{i}" for i in range(bed.nnodes))):
        for where in ([], ["ip", "netns", "exec", ns]):
            shown = subprocess.run([*where, "tc", "qdisc", "show", "dev", "nic0" if where else host_end],
                                   capture_output=True, text=True, check=True).stdout
            out.append(re.search(r" rate (\S+) ", shown).group(1))
    return out


@pytest.mark.testbed
@needs_testbed
def test_a_running_testbed_is_reshaped_by_its_maker_and_from_the_shell(capsys):
    """``Testbed.reshape`` (what cluster.testbed.link_schedule calls) and ``python -m hybrid.testbed reshape``
    (here its main, in this process, which made the testbed): tc's own report of every link changes, both ends."""
    with Testbed(2, LinkShape(100)) as bed:
        assert _rates(bed) == ["100Mbit"] * 4
        bed.reshape([20, 40])
        assert _rates(bed) == ["20Mbit", "20Mbit", "40Mbit", "40Mbit"]
        assert testbed_cli.main(["reshape", "--pid", str(os.getpid()), "--link-mbit", "300"]) == 0
        assert capsys.readouterr().out == f"reshaped 4 interfaces of process {os.getpid()}'s testbed to 300 Mbit/s\n"
        assert _rates(bed) == ["300Mbit"] * 4
        assert testbed_cli.main(["reshape", "--pid", str(os.getpid()), "--link-mbit", "1", "2", "3"]) == 2
        assert capsys.readouterr().err == "error: 3 rates for a testbed of 2 nodes: give one, or one per node\n"
        assert _rates(bed) == ["300Mbit"] * 4  # nothing changed
    assert testbed_cli.main(["reshape", "--pid", str(os.getpid()), "--link-mbit", "300"]) == 2  # gone
    assert "no testbed of process" in capsys.readouterr().err


@pytest.mark.testbed
@needs_testbed
@pytest.mark.background  # mostly waits on the slow phase of its link
def test_a_link_schedule_reshapes_the_links_between_steps_and_comm_adaptive_follows_what_it_measures(tmp_path):
    """2x1 at 1000 Mbit/s, 20 Mbit/s after step 4, 1000 again after step 14 (of 28), under comm=adaptive measuring every 2
    steps (846 KiB of gradients, batches large enough that compute, not the fast link, sets a step's pace):
    each change is logged once, in metrics.json and in TensorBoard; the steps before the job can react take at
    least what 20 Mbit/s allows the gradients; the slow phase's intervals measure 20 Mbit/s; the job moves to
    DiLoCo within three intervals of the slow link and back to hierarchical inside the fast phase, exactly those
    two switches, with every rank's model identical at the end; nothing is left."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = subprocess.Popen([sys.executable, "-m", "hybrid.train", "cluster.testbed.enabled=true",
                            "cluster.testbed.link_mbit=1000", "cluster.nproc_per_node=1", "comm=adaptive",
                            "comm.adapt_every=2", "trainer.max_steps=28", "trainer.log_every=1", "model.width=256",
                            "model.depth=4", "data.batch_size=2048", "data.num_samples=8192",
                            "cluster.testbed.link_schedule=[[4,20],[14,1000]]", f"hydra.run.dir={tmp_path / 'run'}"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = run.communicate(timeout=240)
    assert run.returncode == 0, out[-3000:]
    assert re.findall(r"testbed: links at .*", out) == [
        "testbed: links at 20 Mbit/s after step 4 (cluster.testbed.link_schedule)",
        "testbed: links at 1000 Mbit/s after step 14 (cluster.testbed.link_schedule)"]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["link_changes"] == [{"after_step": 4, "mbit": [20.0, 20.0]},
                                       {"after_step": 14, "mbit": [1000.0, 1000.0]}]
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("testbed/link_mbit")] == [(5, 20.0), (15, 1000.0)]
    step_s = {e.step: e.value for e in events.Scalars("train/step_time_s")}
    transfer = 846 * 1024 * 8 / 20e6
    slow = min(step_s[5], step_s[6])  # before the job can have reacted
    fast = min(step_s[s] for s in (2, 3, 4))  # a busy machine only adds to a step: the least is the step itself
    assert slow > 0.8 * transfer and slow - fast > 0.5 * transfer, step_s  # what the link adds, whatever the CPU
    watched = {entry["step"]: entry for entry in metrics["link_watch"]}
    assert sorted(watched) == list(range(2, 29, 2))
    assert 14 < watched[6]["interval_mbit"] <= 21, watched  # tbf at 20 Mbit/s, as the counters time it
    # Into DiLoCo at the slow phase's first interval where the fast one read slow too (a busy machine's gloo),
    # else at its second (the first held back until another agrees), or its third where a busy machine's fast
    # phase read the link within 3x of 20 Mbit/s (no jump to hold: the median moves one sample at a time); back
    # inside the fast phase: at its second
    # interval on a quiet machine, later where a loaded one's probes read the fast link within 3x of the slow.
    switches = [(s["step"], s["from"].split()[0], s["to"].split()[0]) for s in metrics["switches"]]
    assert len(switches) == 2 and switches[0][1:] == ("hierarchical", "diloco"), switches
    assert switches[0][0] in (6, 8, 10) and switches[1][1:] == ("diloco", "hierarchical") and 16 <= switches[1][0] <= 26
    # DiLoCo's probes: the slow link at its rate (timed after a meeting that spends tbf's burst, which a probe alone
    # read as 35-40 Mbit/s), then a fast one.
    assert 10 < watched[14]["interval_mbit"] <= 25 and watched[switches[1][0]]["interval_mbit"] > 60, watched
    assert metrics["param_checksums_identical"] and metrics["adaptive"]["final_mode"] == "hierarchical"
    assert [e.step for e in events.Scalars("adaptive/switches")] == [step for step, _, _ in switches]
    assert ours(run.pid) == []


@pytest.mark.testbed
@needs_testbed
def test_two_testbeds_one_after_another_and_cleanup_on_error():
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            with Testbed(3, LinkShape(50)):
                assert len(ours(os.getpid())) == 4  # 3 nodes and the service namespace
                raise RuntimeError("boom")
        assert ours(os.getpid()) == []


@pytest.mark.testbed
@needs_testbed
def test_leftover_of_a_killed_run_is_detected_and_removed():
    # A child creates a testbed and is SIGKILLed: nothing of it can clean up.
    child = subprocess.Popen(
        [sys.executable, "-c", "from hybrid.runtime.testbed import *; import sys, time\n"
         "bed = Testbed(2, LinkShape(50)).__enter__(); print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        created = ours(child.pid)
        assert len(created) == 3  # 2 nodes and the service namespace
        child.kill()
        child.wait(timeout=30)
        assert sorted(ours(child.pid)) == sorted(created)
        removed = cleanup_leftovers()
        assert sorted(set(created) & set(removed)) == sorted(created)
        assert ours(child.pid) == []
    finally:
        child.kill()
        child.wait(timeout=30)  # dead before the clean-up looks: a live creator's testbed is not a leftover
        cleanup_leftovers()


@pytest.mark.testbed
@needs_testbed
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_training_run_interrupted_mid_way_leaves_no_namespace(sig, tmp_path):
    run = subprocess.Popen(
        [sys.executable, "-m", "hybrid.train", "cluster.testbed.enabled=true", "cluster.testbed.link_mbit=20",
         "cluster.nproc_per_node=1", "trainer.max_steps=100000", "trainer.log_every=1", "model.width=64"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # As from a terminal: SIGINT at its default, so Python turns it into KeyboardInterrupt. A child
        # inherits an ignored SIGINT from its parent (and Python then installs no handler), which would
        # test this process's signal state instead of the app.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in run.stdout:  # training has started once a status line appears
            if line.startswith("step "):
                break
        # Keep draining: a full pipe would block the app's own last words and hold it past the wait below.
        threading.Thread(target=run.stdout.read, daemon=True).start()
        assert len(ours(run.pid)) == 3  # 2 nodes and the service namespace
        run.send_signal(sig)
        run.wait(timeout=60)
        assert run.returncode != 0
        assert ours(run.pid) == []
    finally:
        run.kill()
        run.wait(timeout=30)


@pytest.mark.unit
def test_without_root_or_user_namespaces_the_testbed_says_what_it_needs(monkeypatch):
    import hybrid.runtime.testbed as testbed

    # Not root, and the user-namespace probe fails for real (an option unshare does not have).
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(testbed, "USERNS", (*testbed.USERNS, "--no-such-option"))
    reason = testbed.testbed_available()
    assert reason.startswith("the network testbed needs root or unprivileged user namespaces (running as uid 1000")
    assert "user.max_user_namespaces" in reason and "kernel.unprivileged_userns_clone=1" in reason
    assert "\n" not in reason
    with pytest.raises(testbed.TestbedError, match="needs root or unprivileged user namespaces"):
        Testbed(2, LinkShape(100)).__enter__()
    assert ours(os.getpid()) == []


@pytest.mark.unit
def test_a_user_namespace_that_fails_to_start_says_why_in_one_line(monkeypatch):
    import hybrid.runtime.testbed as testbed

    monkeypatch.setattr(testbed, "USERNS", ("sh", "-c", "echo 'unshare: Operation not permitted' >&2; exit 1", "x"))
    with pytest.raises(testbed.TestbedError) as caught:
        testbed._UserNamespace()
    assert str(caught.value).endswith("did not start a testbed namespace within 30 s: unshare: Operation not "
                                      "permitted"), caught.value


@pytest.mark.unit
def test_cpu_limits_without_root_are_refused_in_one_line(monkeypatch):
    import hybrid.runtime.testbed as testbed

    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(testbed, "testbed_available", lambda: None)
    with pytest.raises(testbed.TestbedError, match=r"cpu_quota needs root: cgroups cannot be made by uid 1000"):
        Testbed(2, LinkShape(100), cpus=[1.0, 0.5]).__enter__()


@pytest.mark.testbed
@needs_testbed
@pytest.mark.background  # mostly waits (the downed node's heartbeat, the restart)
def test_a_node_whose_links_go_down_is_left_behind_and_the_job_finishes_on_the_other(tmp_path):
    """2x1 on the testbed with two NICs per node, node 1 at a lower rate (the trainer's own path through the
    Hydra keys), cluster.min_nnodes=1: after the step-10 checkpoint node 0's NICs go down (``ip link set nicK
    down`` in its namespace). Node 0 hosts nothing the other needs (the rendezvous store runs in the testbed's
    service namespace): node 1's collectives time out (comm.timeout_s), its agent drops the silent node and
    restarts its worker alone, which resumes as rank 0 and finishes, writing the metrics; the run exits 0."""
    import time

    from helpers.processes import Job

    timeout_s = 8
    job = Job(tmp_path, "cluster.testbed.enabled=true", "cluster.testbed.link_mbit=[500,200]",
              "cluster.testbed.nics_per_node=2", "cluster.nnodes=2", "cluster.nproc_per_node=1",
              "cluster.min_nnodes=1", "cluster.max_restarts=2", "cluster.rdzv_last_call_s=2",
              f"comm.timeout_s={timeout_s}", "trainer.max_steps=30", "trainer.checkpoint_every=5", "trainer.log_every=1",
              "model.width=512", "data.num_samples=2048", f"data.root={tmp_path / 'data'}", "hydra.run.dir=run")
    job.wait_for(r"^step 11/", timeout=180)  # rank 0 saved step 10's checkpoint before its step 11
    for nic in ("nic0", "nic1"):
        subprocess.run(["ip", "netns", "exec", f"hybrid-{job.proc.pid}-n0", "ip", "link", "set", nic, "down"],
                       check=True, timeout=30)
    down = time.monotonic()
    job.wait_for(r"^resumed from step", timeout=timeout_s + 60)  # the timeout, the rendezvous, the restart: no hang
    print(f"node 0's links down -> training resumed on node 1: {time.monotonic() - down:.1f} s "
          f"(comm.timeout_s={timeout_s})")
    code, out, _ = job.finish(timeout=300)
    assert code == 0, out[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 30 and metrics["world_size"] == 1 and metrics["param_checksums_identical"]
    assert [(m["nnodes"], m["why"]) for m in metrics["membership"]] == [(2, "start"), (1, "elastic restart 1")]
    assert ours(job.proc.pid) == []


@pytest.mark.testbed
@needs_testbed
@pytest.mark.background  # mostly waits (comm.timeout_s on the downed link)
def test_in_place_a_node_whose_link_goes_down_is_left_out_within_the_timeout(tmp_path):
    """3x1 on the testbed, cluster.recovery=in_place: after step 11 node 1's NIC goes down. Nodes 0 and 2 time
    out on it (comm.timeout_s), agree without it (its heartbeat no longer reaches the store in the service
    namespace) and train on in the same processes from the step they completed; the run exits 0."""
    import time

    from helpers.processes import Job

    timeout_s = 5
    job = Job(tmp_path, "cluster.testbed.enabled=true", "cluster.testbed.link_mbit=500", "cluster.nnodes=3",
              "cluster.nproc_per_node=1", "cluster.min_nnodes=2", "cluster.max_restarts=1",
              "cluster.recovery=in_place", f"comm.timeout_s={timeout_s}", "trainer.max_steps=16",
              "trainer.log_every=1", "model.width=512", "data.num_samples=2048", f"data.root={tmp_path / 'data'}",
              "hydra.run.dir=run")
    job.wait_for(r"^step 11/", timeout=180)
    subprocess.run(["ip", "netns", "exec", f"hybrid-{job.proc.pid}-n1", "ip", "link", "set", "nic0", "down"],
                   check=True, timeout=30)
    down = time.monotonic()
    job.wait_for(r"^resumed from step \d+ of the survivors' memory", timeout=timeout_s + 60)
    job.wait_for(r"^step \d+/", timeout=60)
    print(f"node 1's link down -> next step on nodes 0 and 2, in place: {time.monotonic() - down:.1f} s "
          f"(comm.timeout_s={timeout_s})")
    code, out, _ = job.finish(timeout=300)
    assert code == 0, out[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 16 and metrics["world_size"] == 2 and metrics["param_checksums_identical"]
    assert [(m["nnodes"], m["why"]) for m in metrics["membership"]] == [(3, "start"), (2, "in place: node(s) [1] lost")]
    assert ours(job.proc.pid) == []


# Two workers per node: with one, a step's compute (6-12 ms) is near the quota's 10 ms period and the ratio found
# fell to 1.96-2.6 on some runs (4.0 on others); with two it is 3.4-7.7.
STRAGGLER_RUN = ["cluster.testbed.enabled=true", "cluster.testbed.link_mbit=1000", "comm=hierarchical",
                 "model.width=512", "model.depth=4", "data.batch_size=64", "data.num_samples=4096",
                 "trainer.max_steps=24", "trainer.log_every=8", "trainer.straggler_steps=5"]


# In place in the modes that keep state beside the weights (DiLoCo's outer state, ZeRO's shards, adaptive's mode):
# the survivors keep their own and nothing moves among them; a node that comes back gets each part from a live peer.
# On the testbed, each node at a quarter of a CPU (cluster.testbed.cpu_quota): a step takes longer and costs the
# machine less, and the returning node's agent (its start unthrottled) joins within fewer of them. Enough steps for
# it to join before the end with two CPU burners beside the job (by step 33 of ZeRO's 60 and 22 of FSDP2's 40).
@pytest.mark.testbed
@needs_testbed
@pytest.mark.parametrize("comm, extra, lost, steps", [
    ("sharded", ("comm.shard_optimizer=true",), 2, 60),  # ZeRO inside the node: the optimizer's shards
    ("hsdp", (), 0, 40),  # torch FSDP2: the parameters' shards too, and node 0 (rank 0's) lost and back
], ids=["zero", "hsdp"])
@pytest.mark.background  # mostly waits (the lost node's heartbeat, its agent's start again): beside the first tiers
def test_in_place_sharded_state_loses_no_shard_and_a_returning_node_gets_them_from_its_local_ranks(comm, extra, lost,
                                                                                                   steps, tmp_path):
    """3x2, AdamW, node ``lost`` SIGKILLed after step 12: the survivors go on with their own shards (every node holds
    every shard: ZeRO's of the optimizer; HSDP's of the parameters and their optimizer state, the mesh and
    fully_shard built again over the survivors), and the node's agent started again joins in place: its worker of
    local rank j receives shard j from the worker of local rank j on a live node, and the run ends on 3 nodes with
    identical replicas (per shard, under HSDP)."""
    out = a_node_killed_in_place(2, comm, lost, tmp_path, extra=(*extra, "optim=adamw"), after=12, steps=steps,
                                 back=True, cpus=0.25)
    joined = re.findall(r"^in place: state as of step \d+ .*", out, re.MULTILINE)[-1]
    received = {int(rank): what for rank, what in re.findall(r"rank (\d) <- ([^;]+)", joined)}
    # Only the returning node's two workers received anything (a node's ranks are consecutive).
    assert len(received) == 2 and min(received) % 2 == 0 and max(received) == min(received) + 1, joined
    sharded = ("optimizer",) if comm == "sharded" else ("model", "optimizer")
    for rank, what in received.items():
        for part in sharded:  # shard j from local rank j of a live node, never the returning node's other worker
            sender = re.search(rf"{part} [\d.]+ [KMG]iB from rank (\d)", what)
            assert sender and int(sender.group(1)) % 2 == rank % 2 and int(sender.group(1)) not in received, joined


@pytest.mark.testbed
@needs_testbed
def test_a_node_given_a_quarter_of_the_cpu_is_named_the_slowest_and_equal_nodes_are_not(tmp_path):
    """2x2 on the testbed, node 1's cgroup at a quarter of node 0's CPU (cluster.testbed.cpu_quota): metrics.json's
    slowest_node is 1, for its compute, and a warning names it during training; with equal shares, nobody."""
    runs = {}
    for name, quota in (("slow", "[1.0,0.25]"), ("equal", "1.0")):
        out = subprocess.run([sys.executable, "-m", "hybrid.train", *STRAGGLER_RUN, f"cluster.testbed.cpu_quota={quota}",
                              f"data.root={tmp_path / 'data'}", f"hydra.run.dir={name}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        # Each namespace's hosts file names the nodes, so that c10d's reverse lookups do not fail (err=-3) per connection.
        assert "hostname of the client socket cannot be retrieved" not in out.stderr, out.stderr[-3000:]
        runs[name] = (out.stdout, json.loads((tmp_path / name / "metrics.json").read_text()))
    stdout, slow = runs["slow"]
    compute = {n: max(r["compute_s"] for r in slow["ranks"] if r["node"] == n) for n in (0, 1)}
    print(f"compute per step, node 0 / node 1: {compute[0] * 1e3:.1f} / {compute[1] * 1e3:.1f} ms (quota 1 : 0.25)")
    assert slow["slowest_node"] == 1, slow["slowest_node_detail"]
    print(f"slowest_node_detail: {slow['slowest_node_detail']}")
    assert slow["slowest_node_detail"]["ratio"] > 2  # a quarter of the CPU: ~4x the compute time
    assert "warning: node 1 is the slowest for 5 steps in a row" in stdout, stdout[-3000:]
    stdout, equal = runs["equal"]
    compute = {n: max(r["compute_s"] for r in equal["ranks"] if r["node"] == n) for n in (0, 1)}
    print(f"equal shares: {compute[0] * 1e3:.1f} / {compute[1] * 1e3:.1f} ms")
    assert equal["slowest_node"] is None, equal["slowest_node_detail"]
    # Each node's NICs, counted by its first worker: two leaders all-reduce S bytes of gradients, so each
    # sends S per step (half in the reduce-scatter, half in the all-gather), plus headers and the accounts.
    gradient_bytes = equal["param_bytes"]
    sent = equal["nic_tx_bytes_per_step_by_node"]
    print(f"NIC bytes per step by node: {[round(b / 1e6, 2) for b in sent]} MB, gradients {gradient_bytes / 1e6:.2f} MB")
    assert len(sent) == 2 and all(gradient_bytes <= b < 1.15 * gradient_bytes for b in sent), sent
    assert "is the slowest" not in stdout
    # The hosts files go with their namespaces, and the cgroups with their testbeds.
    assert ours() == [] and left_by_exited_makers(Path("/sys/fs/cgroup/cpu")) == []
    assert left_by_exited_makers(Path("/etc/netns")) == []


@pytest.mark.testbed
@needs_testbed
def test_the_link_probe_names_the_node_with_the_slow_nic(tmp_path):
    """3x1, node 2's NIC at 100 Mbit/s and the others' at 500: the bench's link probe names node 2."""
    out = subprocess.run(
        [sys.executable, "-m", "hybrid.bench", "--layout", "3x1", "--sizes", "64K", "--algorithms", "flat",
         "--iters", "1", "--warmup", "0", "--testbed-mbit", "500,500,100", "--probe-mb", "1",
         "--output", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads((tmp_path / "b.json").read_text())["link_probe"]
    print("\n".join(probe["table"]))
    assert probe["slow_nodes"] == [2]
    assert "slow: node(s) 2" in out.stdout
    best = probe["best_gbps"]
    assert best[2] < 0.12 and min(best[0], best[1]) > 0.3  # 100 and 500 Mbit/s links, as measured


@pytest.mark.testbed
@pytest.mark.background  # one small run that mostly starts processes: beside the first tiers
@pytest.mark.skipif(as_user.unavailable() is not None, reason=f"{as_user.unavailable()}")
def test_a_user_without_root_trains_on_the_testbed_in_a_user_namespace():
    """The trainer on the testbed run as nobody: the namespaces, links and shaping live in a user namespace of
    the run's own (unshare -rnm), the run finishes, its files are nobody's, its gloo traffic crossed each node's
    shaped NIC, and no holder process is left behind."""
    workdir = Path(tempfile.mkdtemp(prefix="hybrid-nobody-"))
    try:
        workdir.chmod(0o777)
        out = subprocess.run(as_user.as_nobody(
            [sys.executable, "-m", "hybrid.train", "cluster.testbed.enabled=true", "cluster.testbed.link_mbit=100",
             "cluster.nproc_per_node=1", "trainer.max_steps=4", "trainer.log_every=2", "model.width=256",
             "hydra.run.dir=run"], workdir, env={"HOME": str(workdir)}),
            cwd=workdir, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        metrics_file = workdir / "run" / "metrics.json"
        assert metrics_file.stat().st_uid == as_user.NOBODY  # written by the unprivileged user
        metrics = json.loads(metrics_file.read_text())
        assert metrics["steps"] == 4
        # Each node's worker counted its own namespace's nic0: the gradients (and a little more) per step.
        sent = metrics["nic_tx_bytes_per_step_by_node"]
        assert len(sent) == 2 and all(metrics["param_bytes"] <= b < 1.15 * metrics["param_bytes"] for b in sent), sent
        assert "hostname of the client socket cannot be retrieved" not in out.stderr
        # No holder left. (Its namespaces were never the machine's: `ip netns list` as root does not see them, and
        # this test, run beside others, cannot ask it for none at all.)
        left = subprocess.run(["pgrep", "-u", str(as_user.NOBODY), "-f", "unshare --user"], capture_output=True)
        assert left.returncode == 1, left.stdout
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
