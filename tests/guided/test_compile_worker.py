"""The compile worker's budget: compilations past it are stopped on their own thread, one stuck in
native code is left behind without costing the next job, a lost stop is sent again, and a job
whose clients all left is cancelled without being remembered as too slow.

Jobs here are plain functions; no bound on elapsed time is asserted (waits only guard against a
hang), only what each job's waiters get.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from llmserve.guided.worker import CompileAborted, CompileTimeout, CompileWorker

HANG_GUARD = 30  # seconds: far past any budget here; reaching it means a job was lost


def busy(worker: CompileWorker, swallow: int = 0, log: list | None = None):
    """A job that loops in Python until stopped, swallowing the first ``swallow`` stops (as a
    ``__del__`` run by the collector on that thread would)."""
    def fn():
        worker.begin_budget()
        while True:
            try:
                while True:
                    sum(range(100))
            except CompileAborted:
                if log is not None:
                    log.append("stop")
                if swallow and len(log or ()) <= swallow:
                    continue
                raise
    return fn


def quick(worker: CompileWorker, value):
    def fn():
        worker.begin_budget()
        return value
    return fn


def test_a_job_past_its_budget_is_stopped_and_its_key_refused_at_once():
    worker = CompileWorker(timeout=0.2)
    job = worker.submit("slow", busy(worker), "guided_regex", "guided_regex")
    with pytest.raises(CompileTimeout, match="took longer than 0.2s") as raised:
        job.future.result(HANG_GUARD)
    assert raised.value.param == "guided_regex"
    with pytest.raises(CompileTimeout):  # remembered: no second compilation
        worker.submit("slow", quick(worker, 1), "guided_regex", "guided_regex")
    assert worker.submit("fast", quick(worker, 7), "x", None).future.result(HANG_GUARD) == 7


def test_a_lost_stop_is_sent_again():
    worker = CompileWorker(timeout=0.2, grace=HANG_GUARD)
    stops: list[str] = []
    job = worker.submit("swallows", busy(worker, swallow=2, log=stops), "x", None)
    with pytest.raises(CompileTimeout):
        job.future.result(HANG_GUARD)
    assert stops == ["stop", "stop", "stop"]  # two swallowed, the third ended it


def test_a_job_stuck_in_native_code_is_left_behind_and_the_next_jobs_run():
    worker = CompileWorker(timeout=0.1, grace=0.2)
    release = threading.Event()
    ended = threading.Event()

    def stuck():
        worker.begin_budget()
        try:
            release.wait()  # native code: a stop is delivered only once it returns
        finally:
            ended.set()
    first = worker.submit("stuck", stuck, "x", None)
    with pytest.raises(CompileTimeout):
        first.future.result(HANG_GUARD)
    # A fresh worker thread runs the queue while the first one is still stuck; the watchdog
    # must not aim the stuck job's stop at it.
    for i in range(3):
        assert worker.submit(("next", i), quick(worker, i), "x", None).future.result(HANG_GUARD) == i
    slow = worker.submit("slow-after", busy(worker), "x", None)  # and budgets still apply to it
    with pytest.raises(CompileTimeout):
        slow.future.result(HANG_GUARD)
    release.set()
    assert ended.wait(HANG_GUARD)
    first.thread.join(HANG_GUARD)  # back in Python, it takes the stop and leaves the queue to the new thread
    assert not first.thread.is_alive()
    assert worker.submit("after", quick(worker, "ok"), "x", None).future.result(HANG_GUARD) == "ok"
    with pytest.raises(CompileTimeout):  # the stuck constraint is remembered as too slow
        worker.submit("stuck", quick(worker, 1), "x", None)


def test_a_job_whose_clients_all_left_is_cancelled_not_remembered():
    worker = CompileWorker(timeout=HANG_GUARD)
    started = threading.Event()

    def fn():
        worker.begin_budget()
        started.set()
        while True:
            sum(range(100))
    job = worker.submit("left", fn, "x", None)
    assert worker.submit("left", fn, "x", None) is job  # a second client joins the same job
    assert started.wait(HANG_GUARD)
    worker.release(job)
    worker.release(job)
    with pytest.raises(CompileTimeout):
        job.future.result(HANG_GUARD)
    again = worker.submit("left", quick(worker, 3), "x", None)  # not refused from memory
    assert again.future.result(HANG_GUARD) == 3


def test_errors_reach_the_waiters_and_the_switch_interval_comes_back():
    before = sys.getswitchinterval()
    worker = CompileWorker(timeout=HANG_GUARD)

    def fails():
        worker.begin_budget()
        raise ValueError("bad constraint")
    with pytest.raises(ValueError, match="bad constraint"):
        worker.submit("bad", fails, "x", None).future.result(HANG_GUARD)
    assert worker.submit("good", quick(worker, 5), "x", None).future.result(HANG_GUARD) == 5
    deadline = time.monotonic() + HANG_GUARD  # the worker restores it just after answering
    while sys.getswitchinterval() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sys.getswitchinterval() == before


def test_traced_code_still_runs_after_stops():
    """A chat template renders under a trace function (its time cap): stopping compilations must
    leave nothing behind that traced code trips over."""
    from llmserve.text.chat_template import render_template

    worker = CompileWorker(timeout=0.1)
    for key in ("a", "b"):
        with pytest.raises(CompileTimeout):
            worker.submit(key, busy(worker), "x", None).future.result(HANG_GUARD)
    rendered: list[str] = []
    thread = threading.Thread(target=lambda: rendered.append(render_template(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
        {"messages": [{"role": "user", "content": "hi"}] * 50}, timeout=HANG_GUARD)), daemon=True)
    thread.start()
    thread.join(HANG_GUARD)
    assert rendered == ["[user] hi" * 50]


def test_past_max_pending_distinct_constraints_are_503s_and_the_same_one_joins():
    from llmserve.errors import OverloadedError

    worker = CompileWorker(timeout=HANG_GUARD, max_pending=2)
    gate = threading.Event()

    def held():
        gate.wait()  # before its budget starts: not stoppable, holds the worker
        worker.begin_budget()
        return "held"
    first = worker.submit("a", held, "x", None)
    second = worker.submit("b", quick(worker, "b"), "x", None)
    with pytest.raises(OverloadedError, match="too many output constraints"):
        worker.submit("c", quick(worker, "c"), "x", None)
    assert worker.submit("b", quick(worker, "b"), "x", None) is second  # the same constraint joins
    gate.set()
    assert first.future.result(HANG_GUARD) == "held" and second.future.result(HANG_GUARD) == "b"
    assert worker.submit("c", quick(worker, "c"), "x", None).future.result(HANG_GUARD) == "c"  # room again
