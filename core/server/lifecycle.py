"""The server process's life: graceful shutdown on SIGTERM and exit on engine death.

uvicorn alone, on SIGTERM, closes its listening socket at once (new clients get "connection
refused", not a 503 a load balancer understands), waits with no limit for open responses,
then re-raises the signal so the process dies *by* it. ``LLMServer`` changes that:

- first SIGTERM / SIGINT: ``context.draining`` turns on (admission answers 503 + Retry-After,
  readiness probes 503) while the socket stays open; in-flight generation requests get up
  to ``--shutdown-timeout`` seconds to finish; the rest are then aborted (streams end with an
  in-band error, other requests get 503) and the process exits 0. A timeout of 0 aborts at
  once. A second signal aborts what is left right away.
- engine death (the engine loop raised): in-flight requests already got their error from
  the loop; once they have been answered, or after ``ANSWER_GRACE_S`` whatever the clients
  do (one that never reads its response cannot hold the process), the server stops without
  waiting for open connections and the process exits 1 within ``EXIT_DEADLINE_S``, so a
  supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from llmserve.errors import ShuttingDownError

if TYPE_CHECKING:
    from llmserve.server.context import ServerContext

log = logging.getLogger("llmserve.server")

ENGINE_DEAD_EXIT_CODE = 1
ANSWER_GRACE_S = 2.0  # time for aborted requests' error responses to go out (graceful shutdown)
DEAD_ANSWER_GRACE_S = 1.0  # the same after engine death, where the whole exit must fit in EXIT_DEADLINE_S
EXIT_DEADLINE_S = 2.0  # from engine death to process exit, whatever clients or worker threads do


class LLMServer(uvicorn.Server):
    """``uvicorn.Server`` with llmserve's drain-then-exit shutdown and engine-death exit."""

    def __init__(self, config: uvicorn.Config, context: "ServerContext") -> None:
        super().__init__(config)
        self.context = context
        self.exit_code = 0
        self._aio: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self._signals = 0

    async def startup(self, sockets: Any = None) -> None:
        self._aio = asyncio.get_running_loop()
        engine = self.context.engine
        if engine is not None:
            engine.on_death(lambda exc: self._call(self._engine_died))
            if engine.is_dead:
                self._engine_died()
        await super().startup(sockets=sockets)

    # -- signals ----------------------------------------------------------------------------------
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not uvicorn's: it would record the signal and re-raise it after
        # shutdown, so the process would die by SIGTERM instead of exiting 0.
        self._signals += 1
        if self._aio is None:  # not started yet: nothing to drain
            self.should_exit = True
            return
        if self._signals == 1:
            self._call(self.drain)
        else:
            if sig == signal.SIGINT:
                self.force_exit = True
            self._call(self._abort_now)

    def _call(self, func: Any) -> None:
        """Run ``func`` on the event loop (from a signal handler or the engine thread)."""
        if self._aio is None or self._aio.is_closed():
            return
        try:
            self._aio.call_soon_threadsafe(func)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- shutdown ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Start the graceful shutdown (idempotent)."""
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        ctx = self.context
        ctx.draining = True
        timeout = float(ctx.config.shutdown_timeout)
        admission = ctx.admission
        log.info("shutting down: refusing new requests; %d in flight, waiting up to %.0f s", admission.active,
                 timeout)
        done = await admission.wait_idle(timeout) if timeout > 0 else not admission.active
        if not done:
            self._abort_in_flight()
            await admission.wait_idle(ANSWER_GRACE_S)
        self.should_exit = True

    def _abort_in_flight(self) -> None:
        engine = self.context.engine
        if engine is not None and self.context.admission.active:
            log.warning("shutdown timeout: aborting %d in-flight requests", self.context.admission.active)
            engine.abort_all(ShuttingDownError("the server is shutting down; the request was aborted"),
                             refuse_new=True)

    def _abort_now(self) -> None:
        self.context.draining = True
        self._abort_in_flight()
        self.should_exit = True

    # -- engine death -----------------------------------------------------------------------------
    def _engine_died(self) -> None:
        if self.exit_code:
            return
        self.exit_code = ENGINE_DEAD_EXIT_CODE
        log.error("the engine died: stopping the server (exit code %d) so that it can be restarted",
                  ENGINE_DEAD_EXIT_CODE)
        asyncio.ensure_future(self._exit_after_errors())

    async def _exit_after_errors(self) -> None:
        await self.context.admission.wait_idle(DEAD_ANSWER_GRACE_S)
        # Every request has had its error; a response still unfinished belongs to a client that
        # is not reading it, and uvicorn would wait for it forever: drop those connections.
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.abort()
        self.should_exit = True


def make_server(app: Any, context: "ServerContext", *, port: int | None = None) -> LLMServer:
    """The uvicorn server for ``app`` with the HTTP settings of ``context.config``
    (``port`` overrides the configured one)."""
    from llmserve.server.serve import uvicorn_options

    config = context.config
    return LLMServer(uvicorn.Config(app, host=config.host, port=config.port if port is None else port,
                                    **uvicorn_options(config)), context)


def serve(app: Any, context: "ServerContext") -> int:
    """Run ``app`` until it is stopped; return the process exit code."""
    server = make_server(app, context)
    engine = context.engine
    if engine is not None:
        engine.on_death(lambda exc: _exit_watchdog())
    server.run()
    if not server.started:
        return 3  # uvicorn's STARTUP_FAILURE (e.g. the port is taken)
    return server.exit_code


def _exit_watchdog() -> None:
    """After engine death the process ends within ``EXIT_DEADLINE_S`` even if the orderly stop
    stalls (a worker thread busy with a long tokenization or constraint, a stuck socket): past
    that, logs are flushed and the process exits 1 at once. Only for the real process: an
    in-process test server must not take its test runner down."""
    def hard_exit() -> None:
        log.error("the server did not stop within %.0f s of the engine's death: exiting now", EXIT_DEADLINE_S)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(ENGINE_DEAD_EXIT_CODE)

    timer = threading.Timer(EXIT_DEADLINE_S, hard_exit)
    timer.daemon = True
    timer.start()
