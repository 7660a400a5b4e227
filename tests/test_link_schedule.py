"""``cluster.testbed.link_schedule``: the schedule, the workers' and the launcher's sides of a change in steps
(one process, the launcher's thread real, its reshape recorded), and a change in seconds. The testbed's own
``reshape`` and a job that runs through a schedule are in ``test_testbed.py``."""

from __future__ import annotations

import threading

import pytest

from hybrid.runtime.link_schedule import LinkChange, LinkSchedule, LinkScheduler, StepChanges

pytestmark = pytest.mark.unit


def test_a_schedule_gives_each_node_its_rate_from_each_entry_on():
    schedule = LinkSchedule.parse([[4, 20], [8, [500, 100]]], "step", 2)
    assert schedule.changes == (LinkChange(4.0, (20.0, 20.0)), LinkChange(8.0, (500.0, 100.0)))
    assert [schedule.due(done) for done in (0, 3)] == [None, None]
    assert schedule.due(4).mbit == schedule.due(7).mbit == (20.0, 20.0)
    assert schedule.due(8).mbit == schedule.due(1000).mbit == (500.0, 100.0)


@pytest.mark.parametrize("entries, unit, message", [
    ([[4, 20], [3, 500]], "step", "entry [3, 500]: 3 must come after the entry before it (4)"),
    ([[2.5, 20]], "step", "entry [2.5, 20]: 2.5 must be a whole number of steps >= 0"),
    ([[-1, 20]], "s", "entry [-1, 20]: -1 must be seconds >= 0"),
    ([[4, [20, 30, 40]]], "step", "entry [4, [20, 30, 40]]: the rate must be one number > 0 (Mbit/s) or a list of 2"),
    ([[4, 0]], "step", "the rate must be one number > 0"),
    ([[4]], "step", "entry [4] must be [step, mbit]"),
    ([[4, 20]], "min", "cluster.testbed.link_schedule_unit='min' is not one of step, s"),
])
def test_a_bad_schedule_is_one_line_naming_the_entry(entries, unit, message):
    with pytest.raises(ValueError, match=None) as raised:
        LinkSchedule.parse(entries, unit, 2)
    assert message in str(raised.value) and "\n" not in str(raised.value)


class Links:
    """The launcher's reshape, recorded; ``fail`` makes it raise as tc would."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[float]] = []
        self.fail, self.changed = fail, threading.Event()

    def __call__(self, mbit):
        if self.fail:
            raise RuntimeError("tc: no such device")
        self.calls.append(list(mbit))
        self.changed.set()


def test_a_change_in_steps_is_asked_by_rank_0_applied_by_the_launcher_once_and_again_after_a_resume(tmp_path):
    schedule = LinkSchedule.parse([[2, 20], [4, 500]], "step", 2)
    links, lines, barriers = Links(), [], []
    (tmp_path / ".link_schedule").mkdir()
    (tmp_path / ".link_schedule" / "want-9.json").write_text('{"mbit": [1, 1]}')  # an earlier launch's: dropped
    with LinkScheduler(schedule, [1000, 1000], links, tmp_path, lines.append):
        rank0 = StepChanges(schedule, [1000, 1000], tmp_path, 0, lambda: barriers.append(0), timeout_s=60)
        rank1 = StepChanges(schedule, [1000, 1000], tmp_path, 1, lambda: barriers.append(1), timeout_s=60)
        for done in range(6):
            for rank in (rank0, rank1):
                rank.before(done)
        assert links.calls == [[20.0, 20.0], [500.0, 500.0]]  # once per change, from rank 0 only
        # Every rank meets at the first step (the launch rate confirmed: nothing to reshape) and after each change.
        assert barriers == [0, 1, 0, 1, 0, 1]
        assert rank0.applied == [{"after_step": 2, "mbit": [20.0, 20.0]}, {"after_step": 4, "mbit": [500.0, 500.0]}]
        assert rank1.applied == [] and rank1.current == (500.0, 500.0)
        assert lines == ["testbed: links at 20 Mbit/s after step 2 (cluster.testbed.link_schedule)",
                         "testbed: links at 500 Mbit/s after step 4 (cluster.testbed.link_schedule)"]
        # A resume at step 3 asks at once for the rate step 4 is due: the links as the schedule says there.
        resumed = StepChanges(schedule, [1000, 1000], tmp_path, 0, lambda: None, timeout_s=60)
        assert resumed.before(3).mbit == (20.0, 20.0) and resumed.before(3) is None
        assert links.calls[-1] == [20.0, 20.0]
        # An elastic restart before the first change finds the links at 20: it asks for the launch rate back.
        restarted = StepChanges(schedule, [1000, 1000], tmp_path, 0, lambda: None, timeout_s=60)
        assert restarted.before(0) is None and links.calls[-1] == [1000.0, 1000.0]
        assert restarted.before(1) is None and len(links.calls) == 4


def test_a_failed_or_unanswered_change_stops_rank_0_naming_the_step(tmp_path):
    schedule = LinkSchedule.parse([[1, 20]], "step", 1)
    with LinkScheduler(schedule, [1000], Links(fail=True), tmp_path, lambda line: None):
        with pytest.raises(RuntimeError, match="after step 1 failed: RuntimeError: tc: no such device"):
            StepChanges(schedule, [1000], tmp_path, 0, lambda: None, timeout_s=60).before(1)
    # No launcher answers (it died): rank 0 gives up after its timeout instead of hanging.
    (tmp_path / "nobody").mkdir()
    with pytest.raises(RuntimeError, match=r"not reshaped to \[20.0\] Mbit/s after step 1 within 0.2 s"):
        StepChanges(schedule, [1000], tmp_path / "nobody", 0, lambda: None, timeout_s=0.2).before(1)


def test_a_change_in_seconds_is_applied_by_the_launcher_on_its_own_clock_and_a_failure_is_one_line(tmp_path):
    schedule = LinkSchedule.parse([[0, 50]], "s", 2)
    links, lines = Links(), []
    with LinkScheduler(schedule, [500, 500], links, tmp_path, lines.append):
        assert links.changed.wait(timeout=30)
    assert links.calls == [[50.0, 50.0]]
    assert lines == ["testbed: links at 50 Mbit/s 0 s after the launch (cluster.testbed.link_schedule)"]
    failed, said = threading.Event(), []
    with LinkScheduler(schedule, [500, 500], Links(fail=True), tmp_path, lambda line: (said.append(line), failed.set())):
        assert failed.wait(timeout=30)
    assert said == ["testbed: reshaping the links 0 s after the launch failed: RuntimeError: tc: no such device"]
