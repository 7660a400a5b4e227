"""Where the time goes, in one process: the step recorder, the Chrome trace, the straggler rule, the link probe's
schedule and verdict, the CPU limit. The multi-process checks ride on the 2x2 jobs of test_trainer.py (the timeline
of real runs) and test_comm_multiprocess.py (clock alignment, profiler ranges); the testbed ones are in
test_testbed.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from hybrid.app.config import TrainerConfig
from hybrid.app.observability.step_accounts import find_straggler
from hybrid.core.comm import PHASES, PhaseCounters
from hybrid.core.comm.link_probe import LinkReport, round_robin
from hybrid.core.timeline import COMPUTE, StepRecorder, bucket_scope, chrome_trace
from hybrid.runtime import cpu_limit
from hybrid.runtime.testbed import per_node_cpus


@pytest.mark.unit
def test_recorder_splits_backward_at_the_last_gradient_and_keeps_spans_only_in_the_window():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    rec = StepRecorder(PHASES)
    rec.watch_gradients(model)
    for step in (1, 2):
        rec.step, rec.recording = step, step == 2
        with rec.span("data"):
            x = torch.randn(256, 64)
        with rec.span("forward"):
            loss = model(x).square().mean()
        loss.register_hook(lambda g: time.sleep(0.02) or g)  # 20 ms of "compute" before the first gradient
        rec.backward(loss)
        times = rec.end_step()
        assert times.segments["backward"] >= 0.02
        # No DDP: nothing waits after the last gradient, only a sliver of autograd's own exit (8 ms once on a busy
        # machine): the 20 ms before the first gradient are backward's, not comm_wait's.
        assert times.segments["comm_wait"] < times.segments["backward"] / 2
        assert times.segments["data"] > 0 and times.segments["forward"] > 0
    spans = rec.take_spans()
    assert {s.step for s in spans} == {2}  # step 1 ran outside the window
    assert [s.name for s in spans] == ["data", "forward", "backward"] + (["comm_wait"] if len(spans) == 4 else [])
    rec.close()
    assert not model[0].weight._post_accumulate_grad_hooks  # the hooks are gone


@pytest.mark.unit
def test_phases_reach_the_recorder_through_the_counters_with_their_bucket_and_exposed_share():
    rec = StepRecorder(PHASES)
    counters = PhaseCounters(rec)
    rec.recording, rec.step = True, 7
    rec._compute_end = 100.0  # backward's compute ended at t=100 s
    with bucket_scope(3, 4096):
        counters.add("intra_reduce", 2.0, 10, start=97.0)  # 97..99: hidden behind backward
        counters.add("inter_allreduce", 3.0, 20, start=99.0)  # 99..102: 2 s after compute
    counters.add("intra_broadcast", 1.0, 30, start=102.0, bucket={"bucket": 4, "bucket_bytes": 8})
    counters.add("flat_allreduce", 1.0, 40)  # no start: counted, not placed in time
    times = rec.end_step()
    assert times.phases == {"flat_allreduce": 0.0, "intra_reduce": 2.0, "inter_allreduce": 3.0, "intra_broadcast": 1.0}
    assert times.exposed == {"flat_allreduce": 0.0, "intra_reduce": 0.0, "inter_allreduce": 2.0,
                             "intra_broadcast": 1.0}
    spans = rec.take_spans()
    assert [(s.name, s.args["bucket"], s.args["bytes"], s.step) for s in spans] == [
        ("intra_reduce", 3, 10, 7), ("inter_allreduce", 3, 20, 7), ("intra_broadcast", 4, 30, 7)]
    assert counters.snapshot()["flat_allreduce"].seconds == 1.0


@pytest.mark.unit
def test_phases_in_flight_at_once_share_the_exposed_time_instead_of_counting_it_twice():
    """Flat's buckets overlap: two all-reduces 100..104 and 102..106 after a backward ending at 101 expose 5 s of
    wall time (101..106), not 3 + 4; a pipeline's intra and inter phases at once share likewise."""
    rec = StepRecorder(PHASES)
    rec._compute_end = 101.0
    rec.phase("flat_allreduce", 100.0, 104.0, 1, None)
    rec.phase("flat_allreduce", 102.0, 106.0, 1, None)
    times = rec.end_step()
    assert times.phases["flat_allreduce"] == 8.0 and times.exposed["flat_allreduce"] == 5.0
    rec._compute_end = 0.0
    rec.phase("inter_allreduce", 0.0, 4.0, 1, None)
    rec.phase("intra_reduce", 2.0, 4.0, 1, None)  # 2..4 both: 1 s each
    times = rec.end_step()
    assert times.exposed["inter_allreduce"] == 3.0 and times.exposed["intra_reduce"] == 1.0
    assert sum(times.exposed.values()) == 4.0  # the wall time, not more


@pytest.mark.unit
def test_chrome_trace_puts_overlapping_comm_spans_on_tracks_of_their_own_and_aligns_clocks():
    rec = StepRecorder(PHASES)
    rec.recording, rec.step = True, 1
    rec.phase("flat_allreduce", 10.0, 12.0, 1, {"bucket": 0, "bucket_bytes": 4})
    rec.phase("flat_allreduce", 11.0, 13.0, 1, {"bucket": 1, "bucket_bytes": 4})  # in flight with bucket 0
    rec.phase("flat_allreduce", 12.5, 14.0, 1, {"bucket": 2, "bucket_bytes": 4})
    with rec.span("optimizer"):
        pass
    other = StepRecorder(PHASES)
    other.recording = True
    other.phase("intra_reduce", 4.0, 6.0, 1, None)  # rank 3's clock reads 4.0 when rank 0's reads 9.0
    ranks = [{"rank": 0, "node": 0, "offset_s": 0.0, "spans": rec.take_spans()},
             {"rank": 3, "node": 1, "offset_s": 5.0, "spans": other.take_spans()}]
    trace = json.loads(json.dumps(chrome_trace(ranks, origin=9.0, meta={"x": 1})))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    flat = sorted((e for e in spans if e["name"] == "flat_allreduce"), key=lambda e: e["ts"])
    assert [e["tid"] for e in flat] == [1, 2, 1]  # the second overlaps the first; the third fits after the first
    assert flat[0]["ts"] == 1e6 and flat[0]["dur"] == 2e6  # 10 s - origin 9 s
    (reduce,) = [e for e in spans if e["name"] == "intra_reduce"]
    assert reduce["pid"] == 1 and reduce["tid"] == 301 and reduce["ts"] == 0.0  # 4 + 5 - 9
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in trace["traceEvents"] if e["name"] in
             ("process_name", "thread_name")}
    assert {(0, None, "node 0"), (1, None, "node 1"), (0, 1, "rank 0 comm"), (0, 2, "rank 0 comm 2"),
            (1, 301, "rank 3 comm")} <= names
    assert trace["otherData"] == {"x": 1}


def _node(compute: float, backward_share: float = 0.5) -> dict[str, float]:
    parts = {s: compute * (1 - backward_share) / (len(COMPUTE) - 1) for s in COMPUTE}
    parts["backward"] = compute * backward_share
    return {**parts, "compute": compute}


@pytest.mark.unit
def test_a_straggler_is_a_node_beyond_the_margin_of_the_others_median():
    assert find_straggler({0: _node(1.0), 1: _node(4.0, 0.8)}, 0.25) == {"node": 1, "ratio": 4.0,
                                                                          "segment": "backward"}
    assert find_straggler({0: _node(1.0), 1: _node(1.2)}, 0.25) is None  # within the margin
    assert find_straggler({0: _node(1.0), 1: _node(1.1), 2: _node(0.9), 3: _node(1.2)}, 0.25) is None
    assert find_straggler({0: _node(1.0), 1: _node(1.1), 2: _node(0.9), 3: _node(1.5)}, 0.25)["node"] == 3
    assert find_straggler({0: _node(1.0)}, 0.25) is None  # one node waits for nobody


@pytest.mark.unit
@pytest.mark.parametrize("n", range(2, 9))
def test_round_robin_meets_every_pair_once_and_no_node_twice_in_a_round(n):
    rounds = round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


@pytest.mark.unit
def test_link_report_names_the_node_whose_best_link_is_slow():
    def report(rates: dict[int, float]) -> LinkReport:  # a link runs at the slower NIC's rate
        n = len(rates)
        return LinkReport(n, 1, {(a, b): min(rates[a], rates[b]) for a in range(n) for b in range(n) if a != b})

    assert report({0: 0.5, 1: 0.5, 2: 0.1}).slow_nodes() == [2]
    assert report({0: 0.5, 1: 0.5, 2: 0.45}).slow_nodes() == []  # within 25%
    assert report({0: 0.5, 1: 0.1}).slow_nodes() == []  # two nodes: one shared link, nobody to blame
    assert report({0: 0.5, 1: 0.5, 2: 0.1, 3: 0.5}).slow_nodes() == [2]
    assert "slow: node(s) 2" in "\n".join(report({0: 0.5, 1: 0.5, 2: 0.1}).table())


@pytest.mark.unit
@pytest.mark.parametrize("steps, ok", [([3, 5], True), ([1, 1], True), ([5, 3], False), ([0, 2], False),
                                       ([3], False), ("3-5", False), ([3.0, 5], False)])
def test_timeline_window_is_two_steps_in_order(steps, ok):
    t = TrainerConfig(timeline_steps=steps)
    if ok:
        assert t.timeline_window == tuple(steps)
    else:
        with pytest.raises(ValueError, match=r"^trainer.timeline_steps=.* must be \[first, last\]"):
            t.timeline_window  # noqa: B018


@pytest.mark.unit
def test_per_node_cpus_takes_one_for_all_or_one_per_node():
    assert per_node_cpus(0.5, 3) == [0.5, 0.5, 0.5]
    assert per_node_cpus([1, 0.25], 2) == [1.0, 0.25]
    for bad in ([1, 2, 3], 0, 0.05, -1, [1, "x"], True, 10_000):
        with pytest.raises(ValueError, match="must be a number of CPUs"):
            per_node_cpus(bad, 2)


def _cgroups_here() -> str | None:
    try:
        cpu_limit.cgroup_root()
    except cpu_limit.CpuLimitError as exc:
        return str(exc)
    return None


@pytest.mark.testbed
@pytest.mark.skipif(_cgroups_here() is not None, reason=str(_cgroups_here()))
def test_a_process_in_a_node_cgroup_gets_its_cpu_quota_and_the_cgroup_is_removed():
    """A busy loop of 1.5 s wall clock inside a cgroup of 0.2 CPU gets about 0.3 s of CPU, with all its children."""
    path = cpu_limit.create(0, 0.2)
    try:
        busy = ("import os, time\npid = os.fork()\nend = time.monotonic() + 1.5\n"
                "while time.monotonic() < end: pass\nif pid == 0: os._exit(0)\nos.waitpid(pid, 0)")
        proc = subprocess.run([*cpu_limit.join_prefix(path), sys.executable, "-c",
                               f"import os, resource, subprocess, sys\n"
                               f"subprocess.run([sys.executable, '-c', {busy!r}])\n"
                               f"r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
                               f"print(r.ru_utime + r.ru_stime)"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        cpu_s = float(proc.stdout.split()[-1])
        # Unlimited, the parent and its forked child would burn ~3 s of CPU (2 cores); limited, ~0.3 s.
        assert cpu_s < 0.6, cpu_s
    finally:
        cpu_limit.remove(path)
    assert not path.exists()
    assert os.path.isdir(path.parent)
