"""The one worker thread that compiles output constraints, each under a wall-clock budget.

What the static checks (``llmserve.guided.bounds``) cannot see, such as a regex whose
automaton explodes (``(a|b)*a(a|b){13}``), is stopped by time: ``CompileWorker`` runs one
compilation at a time on its own thread, so a slow one never holds the threads other requests
need, and stops it once it has run past its budget or once every client waiting for it has
gone. A Python thread cannot be killed, so stopping raises ``CompileAborted`` inside it (an
asynchronous exception, delivered between two bytecodes: decoders are pure Python), sent again
until the job ends, and only ever to the thread running that job; decoders that loop may also
poll ``check_deadline()``. A job still running ``grace`` seconds after its budget (stuck in
native code) is answered as too slow and left to its thread; a fresh thread takes the queue. A
constraint that timed out is remembered, so sending it again is refused at once.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Hashable

from llmserve.engine.gil import quick_handoff
from llmserve.errors import InvalidRequestError, OverloadedError

log = logging.getLogger("llmserve.guided")

# Sets the exception a thread raises at its next bytecode. (Never called with None to drop one:
# on CPython 3.11 that leaves the interpreter's "something pending" flag set for good, and a
# thread running under a trace function, as a chat template render does, then loops forever.)
_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc
_RESEND = 0.05  # seconds between two stops sent to a job that has not ended


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
    __slots__ = ("key", "fn", "future", "waiters", "state", "deadline", "wake", "label", "param", "thread", "sent")

    def __init__(self, key: Hashable, fn: Callable[[], Any], label: str, param: str | None) -> None:
        self.key, self.fn, self.label, self.param = key, fn, label, param
        self.future: Future = Future()
        self.waiters = 1
        self.state = "queued"  # -> "preparing" (not stoppable) -> "running" -> "done"
        self.deadline = 0.0
        self.wake = threading.Event()  # set when the job ends or loses its last waiter
        self.thread: threading.Thread | None = None  # the worker thread running it
        self.sent = False  # whether a stop was sent to that thread


def _drain() -> None:
    """Raise here, and swallow, a stop that may still be pending on this thread, so that it
    cannot surface later (in the next job, or between taking a job and running it). A pending
    stop is not always raised at once: on CPython 3.11 the flag that makes threads look for one
    is shared, and another thread raising its own clears it. Sending one more to this thread sets
    the flag again (replacing any pending one), and the interpreter lock is not let go between
    the call that sends it and the check right after that raises it."""
    try:
        _SET_ASYNC_EXC(ctypes.c_ulong(threading.get_ident()), ctypes.py_object(CompileAborted))
        _checkpoint()
    except CompileAborted:
        pass


def _checkpoint() -> None:
    """A Python call: entering it checks for pending exceptions, if the call itself did not."""


class CompileWorker:
    """One daemon thread that runs compile jobs one at a time, each under ``timeout`` seconds.

    Jobs are keyed: concurrent requests for the same constraint share one job; a key that timed
    out is remembered (the last 256) and refused at once. At most ``max_pending`` jobs wait;
    more is a 503. A waiter that leaves calls ``release``; the last one leaving cancels the job.
    """

    def __init__(self, timeout: float, max_pending: int = 64, grace: float = 2.0) -> None:
        self.timeout = timeout
        self.max_pending = max_pending
        self.grace = grace  # how long a stopped compilation may take to end before it is left behind
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._jobs: dict[Hashable, _Job] = {}
        self._timed_out: OrderedDict[Hashable, str] = OrderedDict()
        self._lock = threading.Lock()
        self._inject = threading.Lock()  # held while checking a job's state and stopping it
        self._current: _Job | None = None
        self._thread: threading.Thread | None = None
        self._watch_cond = threading.Condition()
        self._watchdog: threading.Thread | None = None
        self._left: list[_Job] = []  # jobs past their budget whose threads were left behind (watchdog's)

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
            except CompileAborted:  # cannot happen (a job's end drops its stop); never lose the thread
                continue

    def _run(self, job: _Job) -> None:
        outcome: Any = None
        error: BaseException | None = None
        with quick_handoff():  # the engine thread gets the lock back quickly meanwhile
            try:
                try:
                    job.state, job.thread = "preparing", threading.current_thread()
                    _local.job = job
                    with self._watch_cond:
                        self._current = job
                        self._watch_cond.notify()
                    outcome = job.fn()
                finally:
                    with self._inject:  # no stop is sent once this job is done
                        job.state = "done"
                    if job.sent:
                        _drain()
            except CompileAborted:
                error = self._timed_out_error(job)
                log.warning("guided decoding: %s", error.args[0] if job.waiters > 0
                            else "a compilation was cancelled (its clients left)")
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request, whatever it is
                error = exc
            finally:
                _local.deadline = _local.job = None
                with self._watch_cond:
                    if self._current is job:
                        self._current = None
                self._settle(job, error, outcome)

    def _timed_out_error(self, job: _Job) -> CompileTimeout:
        """The error for a job stopped past its budget; remembered for its key unless every
        client had left (then it was cancelled, not too slow)."""
        error = CompileTimeout(f"{job.label}: the constraint took longer than {self.timeout:g}s to compile "
                               f"(--guided-compile-timeout); simplify it", param=job.param)
        if job.waiters > 0:
            with self._lock:
                self._timed_out[job.key] = error.args[0]
                while len(self._timed_out) > 256:
                    self._timed_out.popitem(last=False)
        return error

    def _settle(self, job: _Job, error: BaseException | None, outcome: Any) -> None:
        """End ``job`` once (its thread and the watchdog may both try): forget it, answer its waiters."""
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
        job = getattr(_local, "job", None)
        if job is not None:
            job.deadline = time.monotonic() + self.timeout
            _local.deadline = job.deadline
            with self._watch_cond:
                job.state = "running"
                self._watch_cond.notify()

    # -- the watchdog ---------------------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            with self._watch_cond:
                job = self._current if self._current is not None and self._current.state == "running" else None
                if job is None:
                    self._watch_cond.wait(_RESEND if self._left else None)
            self._resend_left()
            if job is None:
                continue
            wait = max(0.0, job.deadline - time.monotonic())
            job.wake.wait(min(wait, _RESEND) if self._left else wait)
            if job.state == "done":
                continue
            if job.waiters > 0 and time.monotonic() < job.deadline:
                job.wake.clear()  # not due yet (or its last waiter left, then another joined)
                continue
            self._stop(job)

    def _send(self, job: _Job) -> bool:
        """Send a stop to the thread running ``job``; False once it no longer runs it."""
        with self._inject:
            thread = job.thread
            if job.state != "running" or thread is None or thread.ident is None:
                return False
            job.sent = True
            _SET_ASYNC_EXC(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileAborted))
            return True

    def _resend_left(self) -> None:
        """Keep stopping the jobs left behind until their threads are back in Python and end them."""
        if self._left:
            self._left = [job for job in self._left if self._send(job)]

    def _stop(self, job: _Job) -> None:
        """Stop ``job`` on its own thread (never on another: a fresh worker waiting for the queue
        would drop the next job it takes). The exception is sent again every 50 ms, as one can be
        lost (raised inside a ``__del__`` or a weakref callback that the collector ran on that
        thread, it is printed and dropped); a job still running after ``grace`` is left behind."""
        ends = time.monotonic() + self.grace
        while self._send(job):
            if time.monotonic() >= ends:
                break
            time.sleep(_RESEND)  # the watchdog's own thread: nothing else waits on it
        else:
            return
        # Stuck in native code: leave that thread behind (stops are still sent to it; it ends its
        # job and exits once it is back in Python) and give the queue a fresh one.
        log.error("guided decoding: a compilation did not stop within %gs of its budget; starting a new worker",
                  self.grace)
        self._left.append(job)
        with self._watch_cond:
            if self._current is job:
                self._current = None
        with self._lock:
            if self._thread is job.thread:
                self._thread = None
            self._start()
        self._settle(job, self._timed_out_error(job), None)
