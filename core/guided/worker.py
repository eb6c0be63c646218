"""The one worker thread that compiles output constraints, each under a wall-clock budget.

What the static checks (``llmserve.guided.bounds``) cannot see, such as a regex whose
automaton explodes (``(a|b)*a(a|b){13}``), is stopped by time: ``CompileWorker`` runs one
compilation at a time on its own thread, so a slow one never holds the threads other requests
need, and stops it once it has run past its budget or once every client waiting for it has
gone. A Python thread cannot be killed, so stopping raises ``CompileAborted`` inside it (an
asynchronous exception, delivered between two bytecodes: decoders are pure Python); decoders
that loop may also poll ``check_deadline()``. A constraint that timed out is remembered, so
sending it again is refused at once.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Hashable

from llmserve.errors import InvalidRequestError, OverloadedError

log = logging.getLogger("llmserve.guided")

_SWITCH = 0.00005  # the interpreter's thread switch interval while a compilation runs


class CompileAborted(BaseException):
    """Raised inside the compile worker to stop a compilation (its budget ran out, or every
    client waiting for it left). A BaseException, so decoders' ``except Exception`` cannot
    swallow it."""


class CompileTimeout(InvalidRequestError):
    """A constraint took longer than ``--guided-compile-timeout`` to compile."""


_local = threading.local()


def check_deadline() -> None:
    """For decoders that loop: raise ``CompileAborted`` once the running compilation is past its
    budget (a no-op outside the compile worker)."""
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise CompileAborted()


class _Job:
    __slots__ = ("key", "fn", "future", "waiters", "state", "deadline", "wake", "label", "param")

    def __init__(self, key: Hashable, fn: Callable[[], Any], label: str, param: str | None) -> None:
        self.key, self.fn, self.label, self.param = key, fn, label, param
        self.future: Future = Future()
        self.waiters = 1
        self.state = "queued"  # -> "preparing" (not stoppable) -> "running" -> "done"
        self.deadline = 0.0
        self.wake = threading.Event()  # set when the job ends or loses its last waiter


def _safe_point() -> None:
    """A function call: where an exception aimed at the job just finished is delivered."""


class CompileWorker:
    """One daemon thread that runs compile jobs one at a time, each under ``timeout`` seconds.

    Jobs are keyed: concurrent requests for the same constraint share one job; a key that timed
    out is remembered (the last 256) and refused at once. At most ``max_pending`` jobs wait;
    more is a 503. A waiter that leaves calls ``release``; the last one leaving cancels the job.
    """

    def __init__(self, timeout: float, max_pending: int = 16) -> None:
        self.timeout = timeout
        self.max_pending = max_pending
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._jobs: dict[Hashable, _Job] = {}
        self._timed_out: OrderedDict[Hashable, str] = OrderedDict()
        self._lock = threading.Lock()
        self._inject = threading.Lock()  # held while checking a job's state and stopping it
        self._current: _Job | None = None
        self._thread: threading.Thread | None = None
        self._watch_cond = threading.Condition()
        self._watchdog: threading.Thread | None = None

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, key: Hashable, fn: Callable[[], Any], label: str, param: str | None) -> _Job:
        """The job for ``key``: an existing one (joined) or a new one queued to run ``fn``, which
        calls ``begin_budget()`` once its one-time preparation is over."""
        with self._lock:
            message = self._timed_out.get(key)
            if message is not None:
                raise CompileTimeout(message, param=param)
            job = self._jobs.get(key)
            if job is not None:
                job.waiters += 1
                return job
            if len(self._jobs) >= self.max_pending:
                raise OverloadedError("too many output constraints are waiting to be compiled; retry later")
            job = self._jobs[key] = _Job(key, fn, label, param)
            self._start()
        self._queue.put(job)
        return job

    def release(self, job: _Job) -> None:
        """A waiter of ``job`` left (its client went away); the last one cancels the job."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            if job.state == "queued":
                self._jobs.pop(job.key, None)
                job.future.cancel()
        job.wake.set()  # a running job is stopped by the watchdog

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="llmserve-guided-compile", daemon=True)
            self._thread.start()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="llmserve-guided-watchdog", daemon=True)
            self._watchdog.start()

    # -- the worker thread ----------------------------------------------------------------------
    def _work(self) -> None:
        me = threading.current_thread()
        while self._thread is me:
            try:
                job = self._queue.get()
                if job.future.done():  # cancelled while queued
                    continue
                self._run(job)
            except CompileAborted:  # aimed at a job that had just finished: nothing to undo
                continue

    def _run(self, job: _Job) -> None:
        outcome: Any = None
        error: BaseException | None = None
        # While this thread compiles, other threads that want the interpreter lock (the engine
        # thread between its native calls, the event loop) get it after 50 µs instead of 5 ms (measured:
        # a torch loop ran 9x slower beside a compiling thread at 5 ms, about as fast as alone at 20 µs).
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, _SWITCH))
        try:
            try:
                job.state = "preparing"
                with self._watch_cond:
                    self._current = job
                    self._watch_cond.notify()
                outcome = job.fn()
            finally:
                with self._inject:
                    job.state = "done"
                _safe_point()
        except CompileAborted:
            gone = job.waiters <= 0
            error = CompileTimeout(
                f"{job.label}: the constraint took longer than {self.timeout:g}s to compile "
                f"(--guided-compile-timeout); simplify it", param=job.param)
            if not gone:
                with self._lock:
                    self._timed_out[job.key] = error.args[0]
                    while len(self._timed_out) > 256:
                        self._timed_out.popitem(last=False)
            log.warning("guided decoding: %s", "a compilation was cancelled (its clients left)" if gone
                        else error.args[0])
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting request, whatever it is
            error = exc
        finally:
            sys.setswitchinterval(switch)
            _local.deadline = None
            with self._watch_cond:
                if self._current is job:
                    self._current = None
            with self._lock:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
            if not job.future.done():
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(outcome)
            job.wake.set()

    def begin_budget(self) -> None:
        """Called by a job's ``fn`` once slow one-time preparation is over (building a decoder's
        tokenizer tables): from here on the compilation runs under its budget."""
        job = self._current
        if job is not None and threading.current_thread() is self._thread:
            job.deadline = time.monotonic() + self.timeout
            _local.deadline = job.deadline
            with self._watch_cond:
                job.state = "running"
                self._watch_cond.notify()

    # -- the watchdog ---------------------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            with self._watch_cond:
                while self._current is None or self._current.state != "running":
                    self._watch_cond.wait()
                job, worker = self._current, self._thread
            job.wake.wait(max(0.0, job.deadline - time.monotonic()))
            if job.state == "done":
                continue
            if job.waiters > 0 and time.monotonic() < job.deadline:
                job.wake.clear()  # its last waiter left, then another joined: keep watching
                continue
            self._stop(job, worker)

    def _stop(self, job: _Job, worker: threading.Thread | None) -> None:
        with self._inject:
            if job.state != "running" or worker is None or worker.ident is None:
                return
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(CompileAborted))
        if not job.wake.wait(2.0):
            # Stuck in native code: leave that thread behind (it exits once it gets back to
            # Python) and give the queue a fresh one.
            log.error("guided decoding: a compilation did not stop within 2s of its budget; starting a new worker")
            with self._lock:
                self._thread = None
                self._jobs.pop(job.key, None)
                if not job.future.done():
                    job.future.set_exception(CompileTimeout(
                        f"{job.label}: the constraint took longer than {self.timeout:g}s to compile "
                        f"(--guided-compile-timeout); simplify it", param=job.param))
                self._start()
