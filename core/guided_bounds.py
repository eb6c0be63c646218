"""Bounds on output constraints: what a request may ask guided decoding to compile, and the one
worker thread that compiles, with a wall-clock budget.

A constraint is checked before any compiling (``check_bounds``): its size in bytes, how deeply
a JSON schema nests, how many items one list or object holds (choices, enum values,
properties, alternatives of a regex group), and how large a regular expression becomes once
its counted repetitions are written out (``a{100000}``, ``(a{1000}){1000}``). These checks are
linear in the constraint and answer a 400 naming the request field.

What the static checks cannot see (a regex whose automaton explodes, such as
``(a|b)*a(a|b){13}``) is stopped by time: ``CompileWorker`` runs one compilation at a time on
its own thread, so a slow one never holds the threads other requests need, and stops it once
it has run past its budget or once every client waiting for it has gone. A Python thread
cannot be killed, so stopping raises ``CompileAborted`` inside it (an asynchronous exception,
delivered between two bytecodes: decoders are pure Python); decoders that loop may also poll
``check_deadline()``. A constraint that timed out is remembered, so sending it again is
refused at once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import queue
import re._constants as sre_c
import re._parser as sre_parse
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from llmserve.errors import InvalidRequestError, OverloadedError

log = logging.getLogger("llmserve.guided")

_SWITCH = 0.00005  # the interpreter's thread switch interval while a compilation runs
_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT)
_GROUPS = (sre_c.ASSERT, sre_c.ASSERT_NOT)


@dataclass(slots=True, frozen=True)
class GuidedLimits:
    """The bounds every constraint is held to (``--guided-*`` flags)."""

    compile_timeout: float = 10.0  # seconds one compilation may run
    max_bytes: int = 65536         # the constraint's size; also a regex's size once written out
    max_depth: int = 64            # nesting of objects and arrays in a JSON schema; of groups in a regex
    max_items: int = 1024          # choices, enum values, properties, anyOf branches, regex alternatives
    max_pending: int = 16          # distinct constraints waiting for the compile worker (more: 503)

    @classmethod
    def from_config(cls, config: Any) -> "GuidedLimits":
        default = cls()
        return cls(**{name: getattr(config, f"guided_{name}", getattr(default, name))
                      for name in ("compile_timeout", "max_bytes", "max_depth", "max_items")})


# -- static checks -------------------------------------------------------------------------------
def check_bounds(kind: str, value: Any, param: str | None, limits: GuidedLimits) -> None:
    """Refuse (400 naming ``param``) a constraint past ``limits``; linear in its size."""
    label = param or kind
    if kind in ("regex", "grammar"):
        _check_size(len(value.encode("utf-8", "surrogatepass")), label, param, limits)
        if kind == "regex":
            check_regex(value, label, param, limits)
    elif kind == "choice":
        if len(value) > limits.max_items:
            raise InvalidRequestError(f"{label}: at most {limits.max_items} choices are allowed, got {len(value)}",
                                      param=param)
        _check_size(sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in value), label, param, limits)
    elif kind == "json_schema":
        patterns = _check_tree(value, label, param, limits)
        _check_size(len(json.dumps(value, ensure_ascii=False)), label, param, limits)
        for path, pattern in patterns:
            check_regex(pattern, f"{label}: the regex pattern at {path}", param, limits)


def _check_size(size: int, label: str, param: str | None, limits: GuidedLimits) -> None:
    if size > limits.max_bytes:
        raise InvalidRequestError(f"{label}: the constraint is too large ({size} bytes; at most "
                                  f"{limits.max_bytes})", param=param)


def _check_tree(value: Any, label: str, param: str | None, limits: GuidedLimits) -> list[tuple[str, str]]:
    """Depth and width of a JSON value, walked without recursion; returns its string
    ``pattern`` keywords (and ``patternProperties`` keys) with their paths."""
    patterns: list[tuple[str, str]] = []
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        where = path or "/"
        if depth > limits.max_depth:
            raise InvalidRequestError(f"{label}: the schema nests too deeply (more than {limits.max_depth} levels "
                                      f"of objects and arrays, at {where})", param=param)
        if len(node) > limits.max_items:
            raise InvalidRequestError(f"{label}: too many items at {where} ({len(node)}; at most "
                                      f"{limits.max_items})", param=param)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            child_path = f"{path}/{key}"
            if key == "pattern" and isinstance(child, str):
                patterns.append((child_path, child))
            elif key == "patternProperties" and isinstance(child, dict):
                patterns.extend((f"{child_path}/{k}", k) for k in child)
            stack.append((child, child_path, depth + 1))
    return patterns


def check_regex(pattern: str, label: str, param: str | None, limits: GuidedLimits) -> None:
    """Syntax (Python's), group nesting, alternatives per group, and the size the pattern takes
    once its counted repetitions are written out."""
    bars = _alternatives(pattern)
    if bars > limits.max_items:  # before parsing: Python's parser is slow on a wide alternation
        raise InvalidRequestError(f"{label}: the regular expression has {bars} alternatives (at most "
                                  f"{limits.max_items})", param=param)
    try:
        tree = sre_parse.parse(pattern)
    except RecursionError:
        raise InvalidRequestError(f"{label}: the regular expression nests too deeply", param=param) from None
    except (sre_c.error, OverflowError, ValueError) as exc:
        raise InvalidRequestError(f"{label}: invalid regular expression: {exc}", param=param) from None
    size = _regex_size(tree, 1, label, param, limits)
    if size > limits.max_bytes:
        raise InvalidRequestError(
            f"{label}: the regular expression is too large once its repetitions are written out (more than "
            f"{limits.max_bytes} characters; a{{100000}} or (a{{1000}}){{1000}} are past it)", param=param)


def _alternatives(pattern: str) -> int:
    """How many ``|`` the pattern has outside character classes (escapes skipped)."""
    count, i, in_class = 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":  # a leading ] is a member
                i += 1
        elif c == "|":
            count += 1
        i += 1
    return count


def _regex_size(items: Any, depth: int, label: str, param: str | None, limits: GuidedLimits) -> int:
    if depth > limits.max_depth:
        raise InvalidRequestError(f"{label}: the regular expression nests more than {limits.max_depth} groups deep",
                                  param=param)
    cap = limits.max_bytes + 1  # sizes are clamped here, so products never grow large
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av
            times = max(low, 1) + 1 if high == sre_c.MAXREPEAT else high
            size = _regex_size(sub, depth + 1, label, param, limits) * max(times, 1)
        elif op is sre_c.SUBPATTERN:
            size = _regex_size(av[3], depth + 1, label, param, limits)
        elif op is sre_c.BRANCH:
            if len(av[1]) > limits.max_items:
                raise InvalidRequestError(f"{label}: a group of the regular expression has {len(av[1])} "
                                          f"alternatives (at most {limits.max_items})", param=param)
            size = sum(_regex_size(b, depth + 1, label, param, limits) for b in av[1])
        elif op in _GROUPS:
            size = _regex_size(av[1], depth + 1, label, param, limits)
        elif op is sre_c.ATOMIC_GROUP:
            size = _regex_size(av, depth + 1, label, param, limits)
        elif op is sre_c.GROUPREF_EXISTS:
            size = sum(_regex_size(b, depth + 1, label, param, limits) for b in av[1:] if b is not None)
        elif op is sre_c.IN:
            size = max(1, len(av) // 8)  # a class is one character; a very long one still costs its text
        else:
            size = 1
        total = min(cap, total + min(cap, size))
    return total


# -- the compile worker --------------------------------------------------------------------------
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
