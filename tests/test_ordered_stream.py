"""The ordered stream that issues a CommGroups' collectives off the caller's thread (single process)."""

from __future__ import annotations

import threading

import pytest
import torch

from hybrid.core.comm.ordered_stream import OrderedStream

pytestmark = pytest.mark.unit


def test_jobs_run_one_at_a_time_in_the_order_they_were_handed_over():
    stream = OrderedStream("test")
    stream.attach()
    stream.attach()  # a second user (a second DDP model) shares the same thread
    seen: list[int] = []
    running = threading.Lock()

    def job(i: int) -> int:
        assert running.acquire(blocking=False), "two jobs ran at once"
        seen.append(i)
        running.release()
        return i * i

    futures = [stream.submit(lambda i=i: job(i)) for i in range(200)]
    assert [f.wait() for f in futures] == [i * i for i in range(200)]
    assert seen == list(range(200))
    stream.detach()
    assert stream.active  # one user still holds it
    stream.detach()
    assert not stream.active


def test_a_failed_job_fails_every_later_one_with_its_cause():
    stream = OrderedStream("test")
    stream.attach()
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("peer 3 is gone")

    first = stream.submit(boom)
    later = stream.submit(lambda: ran.append("later"))
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        first.wait()
    with pytest.raises(RuntimeError, match="an earlier collective on these groups failed: peer 3 is gone"):
        later.wait()
    assert ran == []  # the broken groups were not talked to again
    stream.detach()


def test_call_from_another_thread_waits_behind_queued_jobs_and_returns_the_result():
    stream = OrderedStream("test")
    stream.attach()
    gate = threading.Event()
    order: list[str] = []
    stream.submit(lambda: (gate.wait(5), order.append("bucket")))
    threading.Timer(0.05, gate.set).start()
    assert stream.call(lambda: order.append("direct") or 42) == 42
    assert order == ["bucket", "direct"]
    stream.detach()


def test_on_start_and_on_finish_frame_the_job_and_the_future_completes_last():
    stream = OrderedStream("test")
    stream.attach()
    events: list[str] = []
    future = stream.submit(lambda: events.append("run") or torch.ones(2), on_start=lambda: events.append("start"),
                           on_finish=lambda: events.append("finish"))
    future.add_done_callback(lambda _: events.append("done"))
    assert torch.equal(future.wait(), torch.ones(2))
    stream.detach()
    assert events == ["start", "run", "finish", "done"]


def test_a_stream_without_users_refuses_jobs_and_restarts_on_attach():
    stream = OrderedStream("test")
    with pytest.raises(RuntimeError, match="no user holds this stream"):
        stream.submit(lambda: None)
    stream.attach()
    stream.detach()
    stream.attach()
    assert stream.submit(lambda: "again").wait() == "again"
    stream.detach()


def test_a_failing_callback_fails_its_job_and_the_thread_keeps_serving():
    """Whatever goes wrong around a job, its Future ends (DDP waits on it without a deadline)."""
    stream = OrderedStream("test")
    stream.attach()

    def bad_start() -> None:
        raise ValueError("trace broke")

    first = stream.submit(lambda: "never", on_start=bad_start)
    later = stream.submit(lambda: "also never")
    with pytest.raises(ValueError, match="trace broke"):
        first.wait()
    with pytest.raises(RuntimeError, match="earlier collective on these groups failed: trace broke"):
        later.wait()
    assert stream.active
    stream.detach()


def test_a_user_who_comes_back_while_the_thread_drains_gets_the_same_thread():
    stream = OrderedStream("test")
    stream.attach()
    release = threading.Event()
    threads: list[threading.Thread] = []
    stream.submit(lambda: (release.wait(5), threads.append(threading.current_thread())))
    stream.detach(timeout_s=0.05)  # the last user leaves while a job still runs: the thread drains it
    stream.attach()  # back before it has finished
    release.set()
    stream.submit(lambda: threads.append(threading.current_thread())).wait()
    assert threads[0] is threads[1]
    assert sum(t.name == "test" for t in threading.enumerate()) == 1
    stream.detach()
    assert not stream.active


def test_call_on_the_streams_own_thread_runs_at_once():
    stream = OrderedStream("test")
    stream.attach()
    assert stream.submit(lambda: stream.call(lambda: "inline")).wait() == "inline"
    stream.detach()
