"""The engine thread: runs queued commands and engine steps until stopped or dead.

The blocking ``backend.step`` runs only here; the event loop hands work over as commands
(``submit``) and reads results back through each request's sink. After every iteration the
thread publishes an ``EngineStats`` snapshot for the server to read without locks.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace
from typing import Callable

from llmserve.engine.engine import LLMEngine
from llmserve.engine.stats import EngineStats
from llmserve.errors import EngineDeadError

log = logging.getLogger("llmserve.engine")


class EngineLoop(threading.Thread):
    """Runs queued commands and engine steps until stopped or dead.

    ``stats`` is the latest snapshot, replaced (never mutated) by this thread only.
    ``on_death`` callables run on this thread once, right after the loop died.
    """

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(name="llmserve-engine", daemon=True)
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._dead = False
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.snapshot()
        self.on_death: list[Callable[[BaseException], None]] = []

    def submit(self, command: Callable[[], None]) -> None:
        with self._cv:
            if self._dead:  # nobody would ever run it: fail now instead of hanging the caller
                raise EngineDeadError("the engine is not running; the server is restarting")
            self._inbox.append(command)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not engine.has_work and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    commands = list(self._inbox)
                    self._inbox.clear()
                for command in commands:
                    command()
                if engine.has_work:
                    engine.step()
                self.stats = engine.snapshot()
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Tell the listeners, then fail every request (the queued commands' included)."""
        self.error = exc
        log.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        engine = self.engine
        with self._cv:
            self._dead = True
            leftover = list(self._inbox)
            self._inbox.clear()
        # Listeners first, so anyone who sees a request fail already sees the death recorded.
        for callback in list(self.on_death):
            try:
                callback(exc)
            except Exception:  # one broken listener must not keep the others from hearing
                log.exception("engine death listener failed")
        for command in leftover:  # e.g. add_request: run it so the request gets its error below
            try:
                command()
            except Exception:  # noqa: BLE001 - the engine is dead; every request gets its error below
                pass
        dead = EngineDeadError("the engine failed and is restarting; retry the request")
        for rid in list(engine.requests):
            try:
                engine.abort(rid, error=dead)
            except Exception:  # noqa: BLE001 - one failed abort must not stop the others
                pass
        # The last snapshot's totals stay (counters never go back); nothing runs or waits now.
        self.stats = replace(self.stats, running=0, waiting=0, dead=True)
