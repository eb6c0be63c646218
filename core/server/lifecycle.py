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
import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

import uvicorn

from llmserve import progress
from llmserve.errors import ShuttingDownError

if TYPE_CHECKING:
    from llmserve.server.context import ServerContext

log = logging.getLogger("llmserve.server")

ENGINE_DEAD_EXIT_CODE = 1
ANSWER_GRACE_S = 2.0  # time for aborted requests' error responses to go out (graceful shutdown)
DEAD_ANSWER_GRACE_S = 1.0  # the same after engine death, where the whole exit must fit in EXIT_DEADLINE_S
EXIT_DEADLINE_S = 2.0  # from engine death to process exit, whatever clients or worker threads do


class LLMServer(uvicorn.Server):
    """``uvicorn.Server`` with llmserve's drain-then-exit shutdown and engine-death exit.

    Given ``load`` (``serve.prepare_server``'s), it serves while the model loads on a thread:
    then ``on_ready`` runs and ``/ready`` turns 200, or a failed load stops the server and its
    exception is kept in ``load_error``.
    """

    def __init__(self, config: uvicorn.Config, context: "ServerContext", load: Callable[[], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.context = context
        self.exit_code = 0
        self.load, self.on_ready = load, on_ready
        self.load_error: BaseException | None = None
        self.loader: threading.Thread | None = None
        self.watchdog = False  # the real process: exit hard if stopping stalls after engine death
        self._aio: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None
        self._signals = 0

    async def startup(self, sockets: Any = None) -> None:
        self._aio = asyncio.get_running_loop()
        if self.context.engine is not None:
            self._attach_engine()
        # A model loaded on demand dies the way the default one does: the server exits to be restarted.
        self.context.pool.on_loaded = lambda slot: self._watch(slot.engine)
        await super().startup(sockets=sockets)
        if self.load is not None and self.started:
            self.loader = threading.Thread(target=self._load, name="llmserve-load", daemon=True)
            self.loader.start()

    def _attach_engine(self) -> None:
        self._watch(self.context.pool.default.engine)

    def _watch(self, engine: Any) -> None:
        assert engine is not None
        engine.on_death(lambda exc: self._call(self._engine_died))
        if self.watchdog:
            engine.on_death(lambda exc: _exit_watchdog())
        if engine.is_dead:
            self._engine_died()

    # -- loading ----------------------------------------------------------------------------------
    def _load(self) -> None:
        assert self.load is not None
        try:
            self.load()
        except BaseException as exc:  # noqa: BLE001 - reported by serve() once the server stopped
            self.load_error = exc
            self._call(self._load_failed)
            return
        self._call(self._loaded)

    def _loaded(self) -> None:
        self._attach_engine()
        if self.should_exit:  # stopped while loading: the lifespan has already shut down
            engine = self.context.engine
            if engine is not None:
                engine.shutdown()
            return
        self.context.ready = True
        if self.on_ready is not None:
            self.on_ready()

    def _load_failed(self) -> None:
        self.exit_code = self.exit_code or 1
        self.should_exit = True

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
        timeout = float(ctx.config.limits.shutdown_timeout)
        admission = ctx.admission
        log.info("shutting down: refusing new requests; %d in flight, waiting up to %.0f s", admission.active,
                 timeout)
        done = await admission.wait_idle(timeout) if timeout > 0 else not admission.active
        if not done:
            self._abort_in_flight()
            await admission.wait_idle(ANSWER_GRACE_S)
        self.should_exit = True

    def _abort_in_flight(self) -> None:
        engines = [slot.engine for slot in self.context.pool.loaded()]
        if engines and self.context.admission.active:
            log.warning("shutdown timeout: aborting %d in-flight requests", self.context.admission.active)
            for engine in engines:
                if engine is not None:
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


def make_server(app: Any, context: "ServerContext", *, port: int | None = None, load: Callable[[], None] | None = None,
                on_ready: Callable[[], None] | None = None) -> LLMServer:
    """The uvicorn server for ``app`` with the HTTP settings of ``context.config``
    (``port`` overrides the configured one; ``load`` and ``on_ready`` as ``LLMServer`` takes them)."""
    from llmserve.server.serve import uvicorn_options

    config = context.config
    settings = uvicorn.Config(app, host=config.http.host, port=config.http.port if port is None else port,
                              **uvicorn_options(config, app))
    progress.guard_logs()  # uvicorn's own log handlers exist now: keep them off the live line too
    return LLMServer(settings, context, load, on_ready)


def serve(app: Any, context: "ServerContext", sockets: list[socket.socket] | None = None,
          load: Callable[[], None] | None = None, on_ready: Callable[[], None] | None = None) -> int:
    """Run ``app`` (on ``sockets`` when given, loading the model with ``load`` meanwhile) until it
    is stopped; return the process exit code. A failed load is raised once the server stopped: a
    ``ConfigError`` for what the user can fix (one line), anything else as it came."""
    from llmserve.server.startup import as_startup_error

    port = sockets[0].getsockname()[1] if sockets else None
    server = make_server(app, context, port=port, load=load, on_ready=on_ready)
    server.watchdog = True
    server.run(sockets=sockets)
    if server.load_error is not None:
        raise as_startup_error(server.load_error) or server.load_error
    if not server.started:
        return 3  # uvicorn's STARTUP_FAILURE
    if server.loader is not None and server.loader.is_alive():
        # Stopped while the model was still loading: that thread cannot be interrupted, and the
        # interpreter must not be torn down under it.
        log.info("stopped while the model was loading")
        _exit_now(server.exit_code)
    return server.exit_code


def _exit_now(code: int) -> None:
    """Flush the logs and end the process at once (no interpreter teardown)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def _exit_watchdog() -> None:
    """After engine death the process ends within ``EXIT_DEADLINE_S`` even if the orderly stop
    stalls (a worker thread busy with a long tokenization or constraint, a stuck socket): past
    that, logs are flushed and the process exits 1 at once. Only for the real process: an
    in-process test server must not take its test runner down."""
    def hard_exit() -> None:
        log.error("the server did not stop within %.0f s of the engine's death: exiting now", EXIT_DEADLINE_S)
        _exit_now(ENGINE_DEAD_EXIT_CODE)

    timer = threading.Timer(EXIT_DEADLINE_S, hard_exit)
    timer.daemon = True
    timer.start()
