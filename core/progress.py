"""Progress of slow start-up phases (GGUF conversion, kernel builds, weight packing, KV pool).

``with progress.phase("packing weights", total=121, unit="matrices"): ... progress.advance()``.
On a terminal the open phase is one live line, redrawn in place; anywhere else (a log file, a
pipe, a supervisor) it becomes plain log lines on ``llmserve.progress``: the first once the
phase has run a second, then one every ``PLAIN_INTERVAL_S`` at most, never a carriage return.
A phase that took a second or more ends with one ``done in`` line. ``bar_factory()`` gives a
tqdm-shaped class so third-party progress bars (transformers') land here instead of writing
``\\r`` lines of their own. ``LLMSERVE_PROGRESS=plain|live|off`` overrides the detection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator

log = logging.getLogger("llmserve.progress")

PLAIN_INTERVAL_S = 5.0   # between two plain lines of one phase
PLAIN_FIRST_S = 1.0      # a phase quicker than this prints no progress line, only (maybe) its end
LIVE_REFRESH_S = 0.2
DONE_AFTER_S = 1.0       # phases at least this long report their end at INFO
BAR_WIDTH = 24           # characters of a byte phase's bar on a live line


@dataclass
class Phase:
    """One slow step: a name, an optional total and how much of it is done."""

    name: str
    total: int | None = None
    unit: str = ""
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last_line: float | None = None  # when its latest plain line was written
    thread: int = field(default_factory=threading.get_ident)

    def advance(self, n: int = 1) -> None:
        self.done += n

    def describe(self, now: float | None = None, bar: bool = False) -> str:
        """``name: done/total unit (pct%), elapsed``; a phase counted in bytes (unit ``B``) in MB,
        and with ``bar`` (a terminal's live line) a bar of its share done."""
        elapsed = (now if now is not None else time.monotonic()) - self.started
        done = min(self.done, self.total) if self.total else self.done
        in_bytes = self.unit == "B"
        unit = " MB" if in_bytes else f" {self.unit}" if self.unit else ""
        big = (self.total or done) >= 10_000_000  # millions of weights read better as such

        def shown(n: int) -> str:
            return f"{n / 1e6:.1f}" if in_bytes else f"{n / 1e6:.1f}M" if big else str(n)

        if bar and in_bytes and self.total:
            filled = BAR_WIDTH * done // self.total
            return (f"{self.name} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {shown(done)}/{shown(self.total)}"
                    f"{unit} ({100 * done // self.total}%), {elapsed:.0f} s")

        if self.total:
            count = f"{shown(done)}/{shown(self.total)}{unit} ({100 * done // self.total}%)"
        elif self.done:
            count = f"{shown(done)}{unit}"
        else:
            count = ""
        return f"{self.name}: {count + ', ' if count else ''}{elapsed:.0f} s"


class Reporter:
    """Draws the open phases on ``stream`` (live) or logs them (plain); see the module docstring."""

    def __init__(self, stream: IO[str] | None = None, mode: str | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode or _detect_mode(self.stream)
        self._phases: list[Phase] = []
        self._lock = threading.RLock()
        self._ticker: threading.Thread | None = None
        self._shown = False  # a live line is on screen

    @property
    def live(self) -> bool:
        return self.mode == "live"

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "") -> Iterator[Phase]:
        """Open a phase for the duration of the ``with`` block; nested phases show innermost first."""
        current = self.begin(name, total, unit)
        try:
            yield current
        finally:
            self.end(current)

    def begin(self, name: str, total: int | None = None, unit: str = "") -> Phase:
        current = Phase(name, total, unit)
        with self._lock:
            self._phases.append(current)
            if self.mode != "off" and (self._ticker is None or not self._ticker.is_alive()):
                self._ticker = threading.Thread(target=self._tick, name="llmserve-progress", daemon=True)
                self._ticker.start()
        return current

    def end(self, current: Phase) -> None:
        with self._lock:
            if current in self._phases:
                self._phases.remove(current)
            self.clear()
        took = time.monotonic() - current.started
        level = logging.INFO if took >= DONE_AFTER_S and self.mode != "off" else logging.DEBUG
        log.log(level, "%s: done in %.1f s", current.name, took)

    def advance(self, n: int = 1) -> None:
        """Advance the innermost phase this thread opened (phases of other threads, such as a
        kernel build running beside the load, are left alone); no-op when there is none."""
        me = threading.get_ident()
        with self._lock:
            mine = [p for p in self._phases if p.thread == me]
            if mine:
                mine[-1].advance(n)

    def current(self) -> Phase | None:
        with self._lock:
            return self._phases[-1] if self._phases else None

    def clear(self) -> None:
        """Take the live line off the screen (before a log line is written over it)."""
        with self._lock:
            if self._shown:
                self._write("\r\x1b[2K")
                self._shown = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream must not break the load
            pass

    def _tick(self) -> None:
        while True:
            time.sleep(LIVE_REFRESH_S if self.live else 0.25)
            with self._lock:
                if not self._phases:
                    self._ticker = None
                    return
                now = time.monotonic()
                if self.live:
                    text = " | ".join(p.describe(now, bar=True) for p in self._phases[-2:])
                    self._write("\r\x1b[2K" + text[:_columns() - 1])
                    self._shown = True
                    continue
                for p in self._phases:
                    due = p.started + PLAIN_FIRST_S if p.last_line is None else p.last_line + PLAIN_INTERVAL_S
                    if now >= due:
                        p.last_line = now
                        log.info("%s", p.describe(now))


def _detect_mode(stream: IO[str]) -> str:
    wanted = os.environ.get("LLMSERVE_PROGRESS", "").strip().lower()
    if wanted in ("plain", "live", "off"):
        return wanted
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "live" if tty and os.environ.get("TERM", "") != "dumb" else "plain"


def _columns() -> int:
    return max(20, shutil.get_terminal_size((80, 24)).columns)  # $COLUMNS, the terminal, else 80


class _LogGuard(logging.Filter):
    """Clears the live line before a log record is written, so it is never appended to it."""

    def __init__(self, reporter: Reporter) -> None:
        super().__init__()
        self.reporter = reporter

    def filter(self, record: logging.LogRecord) -> bool:
        self.reporter.clear()
        return True


_reporter: Reporter | None = None


def reporter() -> Reporter:
    """The process-wide reporter (on stderr)."""
    global _reporter
    if _reporter is None:
        _reporter = Reporter()
    return _reporter


def install(stream: IO[str] | None = None, mode: str | None = None) -> Reporter:
    """Make a fresh process-wide reporter and keep log lines off its live line (``setup_logging`` calls it)."""
    global _reporter
    _reporter = Reporter(stream, mode)
    guard_logs()
    return _reporter


def guard_logs() -> None:
    """Have every handler configured so far clear the live line before it writes a record (call
    again once a library configured its own handlers, as uvicorn does)."""
    if _reporter is None or not _reporter.live:
        return
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers}:
        guards = [f for f in handler.filters if isinstance(f, _LogGuard)]
        if guards:
            guards[0].reporter = _reporter
        else:
            handler.addFilter(_LogGuard(_reporter))


def phase(name: str, total: int | None = None, unit: str = "") -> contextlib.AbstractContextManager[Phase]:
    """``with phase(...)`` on the process-wide reporter."""
    return reporter().phase(name, total, unit)


def advance(n: int = 1) -> None:
    """Advance the innermost open phase of the process-wide reporter."""
    reporter().advance(n)


class Bar:
    """A tqdm-shaped progress bar that is a phase of the process-wide reporter (named by its
    ``desc``): what ``bar_factory`` hands to libraries that draw tqdm bars of their own."""

    fallback = "working"

    def __init__(self, iterable: Iterable[Any] | None = None, desc: str | None = None,
                 total: int | float | None = None, *args: Any, **kwargs: Any) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.n = 0
        self.total = total
        name = (desc or self.fallback).strip().rstrip(".:").strip() or self.fallback
        self._phase: Phase | None = None if kwargs.get("disable") else reporter().begin(
            name, int(total) if total else None)

    def __iter__(self) -> Iterator[Any]:
        try:
            for item in self.iterable or ():
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)
        if self._phase is not None:
            self._phase.done = self.n

    def close(self) -> None:
        if self._phase is not None:
            reporter().end(self._phase)
            self._phase = None

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        if self._phase is not None and desc:
            self._phase.name = desc.strip().rstrip(".:")

    def reset(self, total: int | float | None = None) -> None:
        self.n = 0
        if self._phase is not None:
            self._phase.done = 0
            if total:
                self._phase.total = int(total)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """Ignored: a phase line has no room for it (so are ``set_postfix_str`` and ``refresh``)."""

    set_postfix_str = refresh = set_postfix

    @classmethod
    def write(cls, s: str, *args: Any, **kwargs: Any) -> None:
        log.info("%s", s)

    @classmethod
    def get_lock(cls) -> threading.RLock:
        return reporter()._lock

    @classmethod
    def set_lock(cls, lock: Any) -> None:
        """Ignored: the reporter has its own lock."""


def bar_factory(fallback: str = "working") -> type[Bar]:
    """``Bar`` naming its phase ``fallback`` when a bar has no ``desc``, for libraries that take a
    tqdm class or call ``tqdm(iterable, desc=...)``."""
    return type("Bar", (Bar,), {"fallback": fallback})
