"""The adaptive choice (hybrid.core.adaptive): the link measured from the counters' samples, each mode priced by
the cost model, a chooser that switches on a real change and not on noise, and the plan of switches at given
steps (comm.adapt_plan). The trainer's switch is tested on the trainer's 2x2 job (tests/test_trainer.py) and on
the testbed (tests/test_testbed.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hybrid.core.adaptive import LinkEstimate, Mode, ModeChooser, ModePlan, diloco_sync_every, expected_step_s, with_link
from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout

pytestmark = pytest.mark.unit

MIB = 2**20
HIER, HIER_BF16, SHARDED = Mode("hierarchical"), Mode("hierarchical", "bf16"), Mode("sharded")
TESTBED = Model(intra=Level.from_bandwidth(50, 20.0), inter=Level.from_bandwidth(200, 0.5))


def test_the_link_is_the_median_of_recent_samples_and_follows_a_change_at_its_second_sample():
    link = LinkEstimate(window=3, min_bytes=1000)
    assert link.mbit is None
    link.add(10_000, 10_000 * 8 / 20e6)  # 20 Mbit/s
    link.add(500, 1.0)  # too few bytes: latency, not rate
    link.add(10_000, 10_000 * 8 / 22e6)
    link.add(10_000, 10_000 * 8 / 2e6)  # one step that waited on a straggler: held back
    assert link.mbit == pytest.approx(21.0) and link.held == pytest.approx(2.0)
    link.add(10_000, 10_000 * 8 / 24e6)  # back to normal: the straggler is dropped
    assert link.mbit == pytest.approx(22.0) and link.held is None
    link.add(10_000, 10_000 * 8 / 500e6)  # the link changed: one sample is not yet a change
    assert link.mbit == pytest.approx(22.0)
    link.add(10_000, 10_000 * 8 / 150e6)  # a second off the same side: the window starts afresh from the two
    assert link.mbit == pytest.approx(325.0) and list(link.samples) == pytest.approx([500.0, 150.0])
    link.add(10_000, 10_000 * 8 / 2e6)  # far below: held; then one far above again is not the same change
    link.add(10_000, 10_000 * 8 / 2000e6)
    assert link.held == pytest.approx(2000.0) and link.mbit == pytest.approx(325.0)
    link.forget()
    assert link.mbit is None and link.held is None


def test_every_step_modes_are_the_cost_models_all_reduce_and_16_bits_halve_only_the_inter_node_bytes():
    layout, nbytes = Layout.uniform(2, 4), 24.4 * MIB
    assert expected_step_s(HIER, 0.5, TESTBED, layout, nbytes) == pytest.approx(
        0.5 + predict(TESTBED, "hierarchical", layout, nbytes)["total"])
    full = predict(TESTBED, "hierarchical", layout, nbytes)
    half = expected_step_s(HIER_BF16, 0.0, TESTBED, layout, nbytes)
    assert half == pytest.approx(full["total"] - full["inter_allreduce"] / 2, rel=0.01)


def candidates(h: int) -> list[Mode]:
    return [HIER, SHARDED, HIER_BF16, Mode("diloco", sync_every=h)]


def priced(mbit: float, nbytes: float, compute_s: float) -> dict[Mode, float]:
    """Each candidate's expected step on 2x4, DiLoCo at the interval the link carries (its exchange: a sync
    every step's time less the node's own all-reduce, which a one-node layout prices)."""
    model, layout = with_link(TESTBED, mbit), Layout.uniform(2, 4)
    sync_s = expected_step_s(Mode("diloco"), 0.0, model, layout, nbytes) - expected_step_s(
        Mode("diloco"), 0.0, model, Layout.uniform(1, 4), nbytes)
    h = diloco_sync_every(sync_s, compute_s)
    return {mode: expected_step_s(mode, compute_s, model, layout, nbytes) for mode in candidates(h)}


def test_a_link_at_500_mbit_keeps_every_step_training_and_one_at_20_takes_diloco_at_the_interval_it_carries():
    """A small model (2 MiB of gradients, 0.7 s of compute per step): at 500 Mbit/s every-step all-reduce
    costs a few percent, within the slack of DiLoCo's time, so it stays; at 20 Mbit/s it would double the step."""
    fast, slow = priced(500, 2 * MIB, 0.7), priced(20, 2 * MIB, 0.7)
    chooser = ModeChooser(candidates(16), HIER, slack=0.15, margin=0.05, patience=2)
    assert [chooser.choose(fast) for _ in range(3)] == [HIER] * 3, fast
    assert [str(m) for m in fast][-1] == "diloco H=8" and [str(m) for m in slow][-1] == "diloco H=16"
    assert [str(chooser.choose(slow)) for _ in range(2)] == ["hierarchical", "diloco H=16"], slow
    # Back on the fast link: DiLoCo first at the interval that link carries, then every step again.
    assert [str(chooser.choose(fast)) for _ in range(2)] == ["diloco H=8", "hierarchical"], fast


def test_our_measured_diloco_and_hierarchical_speeds_on_a_50_mbit_link_are_what_the_pricing_says():
    """RESULTS 12.1 (GPT-2, 24.4 MiB of gradients, 2x4 behind 50 Mbit/s NICs): DiLoCo H=32 in fp32 trained at
    0.84x the samples/s of DDP with no network limit (inner steps of 0.72 s, a sync ~4.5 s), hierarchical every
    step at 0.12x. The pricing, from the link's rate alone, lands near both."""
    layout, nbytes, step_s = Layout.uniform(2, 4), 24.4 * MIB, 0.72
    model = with_link(TESTBED, 50)
    diloco = expected_step_s(Mode("diloco", sync_every=32), step_s, model, layout, nbytes)
    every_step = expected_step_s(HIER, step_s, model, layout, nbytes)
    assert step_s / diloco == pytest.approx(0.84, abs=0.06)
    assert step_s / every_step == pytest.approx(0.12, abs=0.05)


def test_the_chooser_waits_for_a_margin_at_several_choices_and_does_not_flap_on_noise():
    slow_h = Mode("diloco", sync_every=32)
    chooser = ModeChooser([HIER, slow_h], HIER, slack=0.15, margin=0.05, patience=2)
    # Every-step 1.12-1.25x DiLoCo's time: inside the keep band (1.2x) or out of it only once in a row.
    noisy = [{HIER: 1.12, slow_h: 1.0}, {HIER: 1.25, slow_h: 1.0}, {HIER: 1.18, slow_h: 1.0}, {HIER: 1.3, slow_h: 1.0}]
    assert [chooser.choose(t) for t in noisy] == [HIER] * 4
    assert chooser.choose({HIER: 1.3, slow_h: 1.0}) == slow_h  # twice out: it switches
    # Back only once every-step is clearly affordable again (within 1.1x), twice in a row.
    assert [chooser.choose({HIER: 1.12, slow_h: 1.0}) for _ in range(3)] == [slow_h] * 3
    assert [chooser.choose({HIER: 1.05, slow_h: 1.0}) for _ in range(2)] == [slow_h, HIER]
    with pytest.raises(ValueError, match="no expected step time for diloco none"):
        chooser.choose({HIER: 1.0})


def test_diloco_takes_the_smallest_interval_the_link_carries_and_bad_modes_are_refused():
    assert diloco_sync_every(4.0, 1.0) == 64  # 4 s / 64 <= 0.1 s
    assert diloco_sync_every(0.5, 1.0) == 8
    assert diloco_sync_every(100.0, 1.0) == 128  # none carries it: the longest
    with pytest.raises(ValueError, match="mode algorithm 'ring' is not one of hierarchical, sharded, diloco"):
        Mode("ring")
    with pytest.raises(ValueError, match="sync_every=4 must be 1 every step"):
        Mode("hierarchical", sync_every=4)
    assert [str(m) for m in (HIER_BF16, Mode("diloco", sync_every=32))] == ["hierarchical+bf16", "diloco H=32"]


def test_a_plan_names_the_mode_due_after_each_step_and_a_bad_one_is_refused_in_one_line():
    plan = ModePlan([[4, "diloco"], [8, "sharded+bf16"]])
    assert [plan.due(done) for done in (0, 3, 4, 7, 8, 100)] == [
        None, None, Mode("diloco"), Mode("diloco"), Mode("sharded", "bf16"), Mode("sharded", "bf16")]
    assert [Mode.parse(m.name, m.sync_every) for m in (HIER_BF16, Mode("diloco", sync_every=32))] == [
        HIER_BF16, Mode("diloco", sync_every=32)]
    for entries, needle in (([[4, "ring"]], "entry [4, 'ring']: mode 'ring' is not one of"),
                            ([[-1, "diloco"]], "entry [-1, 'diloco'] must be [after_step, mode]"),
                            ([[4, "diloco"], [4, "sharded"]], "must list its steps in increasing order, each once"),
                            ([["4", "diloco"]], "must be [after_step, mode] with after_step a whole number")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            ModePlan(entries)


def test_a_chooser_restored_from_its_state_chooses_as_the_one_it_was_saved_from():
    slow_h = Mode("diloco", sync_every=32)
    diloco_fastest = {HIER: 1.0, slow_h: 0.5}
    straight = ModeChooser([HIER, slow_h], HIER, patience=2)
    assert straight.choose(diloco_fastest) == HIER  # once: a switch waiting to be confirmed
    again = ModeChooser([HIER, slow_h], HIER, patience=2)
    again.load_state_dict(straight.state_dict())
    fresh = ModeChooser([HIER, slow_h], HIER, patience=2)
    assert [straight.choose(diloco_fastest), again.choose(diloco_fastest), fresh.choose(diloco_fastest)] == [
        slow_h, slow_h, HIER]  # the restored one confirms it, as the straight one does; a fresh one starts over
    again.reset(HIER)
    assert again.current == HIER and again.state_dict()["wanted"] is None


@pytest.mark.parametrize(("measured", "fragments", "overlap_steps", "runs"), [
    (32, 1, 1, 32),  # unstreamed: as measured
    (7, 4, 1, 8),    # rounded up to a multiple of the fragments
    (9, 2, 1, 10),
    (3, 2, 2, 4),    # at least fragments x overlap_steps: each exchange lands before the next leaves
])
def test_a_measured_diloco_interval_is_rounded_up_to_one_its_streaming_can_run(measured, fragments, overlap_steps, runs):
    from hybrid.app.replicas.adaptive import streamable

    every = streamable(measured, fragments, overlap_steps)
    assert every == runs and every % fragments == 0 and every // fragments >= overlap_steps


def test_under_an_overlapped_diloco_the_link_watch_leaves_the_exchanges_counted_seconds_out():
    """An overlapped exchange's counted seconds are the wait left after the inner steps it ran beside: counted, they
    read the link as fast as it is not. Under comm.overlap the watch leaves DiLoCo's inter-node phase out (its probe
    measures the link); without overlap, and in the every-step modes, it counts it."""
    from hybrid.app.observability.link_watch import LinkWatch
    from hybrid.app.observability.metrics import NullMetrics
    from hybrid.core.comm.counters import PhaseStats

    phases = {"inter_allreduce": PhaseStats(seconds=0.001, bytes=1 << 20, calls=1),
              "intra_reduce": PhaseStats(seconds=0.002, bytes=1 << 18, calls=1)}
    counted = {}
    for running, overlaps in (("diloco", True), ("diloco", False), ("hierarchical", True)):
        watch = LinkWatch(5, Layout.uniform(2, 2), 1 << 20, Mode.parse(running, 32), NullMetrics())
        watch.diloco_overlaps = overlaps
        watch.step(1, phases, 0.1)
        counted[(running, overlaps)] = [watch._sums[0], watch._inter_steps[0], *watch._sums[2:4]]
    assert counted[("diloco", True)] == [0.0, math.inf, 1 << 18, 0.002]
    assert counted[("diloco", False)] == counted[("hierarchical", True)] == [1 << 20, 0.001, 1 << 18, 0.002]


def test_the_link_watch_times_the_link_by_each_steps_last_arrival_not_by_a_rank_that_waited(monkeypatch):
    """Two leaders, two steps: at the first the other leader's batch came late, so this one's all-reduce counted
    0.2 s of waiting; at the second it was the other way round. Each step's least seconds (its last arrival's) are
    the link's: 2 MiB per NIC in 0.021 s is 799 Mbit/s, where the slowest rank's sums (0.5 s) read 34."""
    from hybrid.app.observability.link_watch import LinkWatch
    from hybrid.app.observability.metrics import NullMetrics
    from hybrid.core.comm.counters import PhaseStats

    def phases(seconds: float) -> dict[str, PhaseStats]:
        return {"inter_allreduce": PhaseStats(seconds=seconds, bytes=1 << 20, calls=1)}

    watches = [LinkWatch(2, Layout.uniform(2, 1), 1 << 20, Mode.parse("hierarchical"), NullMetrics()) for _ in range(2)]
    for watch, seconds in zip(watches, (0.200, 0.010)):
        watch.step(1, phases(seconds), 0.3)
    handed: list[torch.Tensor] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, **_: handed.append(t.clone()))
    watches[1].step(2, phases(0.300), 0.3)  # the estimate's collectives: what the other leader hands in, kept
    theirs = iter(handed)

    def reduce_with_theirs(t: torch.Tensor, op: object = None, **_: object) -> None:
        other = next(theirs)
        t.copy_(torch.maximum(t, other) if op == torch.distributed.ReduceOp.MAX else t + other)
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce_with_theirs)
    watches[0].step(2, phases(0.011), 0.3)
    assert watches[0].history[-1]["interval_mbit"] == pytest.approx(2 * 8 * (1 << 20) / 0.021 / 1e6, rel=1e-3)
