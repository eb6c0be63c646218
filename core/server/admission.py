"""Admission control: caps on in-flight work, checked before a request costs anything.

Every generation route of every dialect calls ``context.admission.check(n)`` first thing,
with ``n`` the number of sequences it will generate (n, best_of, or one per prompt), before
any templating, tokenizing or grammar compiling. Over a cap, or while the server drains
for shutdown, the check raises ``OverloadedError`` (503 with Retry-After; TGI routes render
it as 429 ``overloaded``). The reservation lives in the HTTP request's ``RequestContext`` and
is given back when the request's response ends, however it ends.

Counts are kept on the event loop (no locks): ``in_flight`` sequences reserved by open
requests, and ``waiting_tokens`` prompt tokens submitted to the engine but not yet prefilled;
the engine's own queue comes from ``engine.stats()``.
A request "waits" when it cannot start at once: more sequences are in flight than the
engine runs in one batch (``--max-num-seqs``), or the engine already has a queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from llmserve.config import ServerConfig
from llmserve.errors import EngineDeadError, InvalidRequestError, OverloadedError
from llmserve.request import deadline_after
from llmserve.request_context import RequestContext, current_context

if TYPE_CHECKING:
    from llmserve.engine.client import EngineClient
    from llmserve.server.metrics import Metrics
    from llmserve.server.pool import ModelPool


class AdmissionHost(Protocol):
    """What admission reads of the server (``ServerContext`` is one); typed by shape so that the
    context, which owns the controller, and the controller do not import each other."""

    config: ServerConfig
    draining: bool
    engine: "EngineClient | None"
    metrics: "Metrics"
    pool: "ModelPool"

log = logging.getLogger("llmserve.server")


class Admission:
    """The server's admission controller (``context.admission``)."""

    def __init__(self, context: AdmissionHost) -> None:
        self.context = context
        self.in_flight = 0           # sequences reserved by open requests
        self.waiting_tokens = 0      # prompt tokens waiting for their prefill
        self.requests: set[RequestContext] = set()
        self.rejected = 0
        self.opened = 0              # HTTP requests seen, ever (the heap trimmer's sign of activity)
        self._idle = asyncio.Event()  # binds to the event loop on first use

    # -- limits ---------------------------------------------------------------------------------
    @property
    def config(self) -> ServerConfig:
        return self.context.config

    def check(self, n: int = 1) -> None:
        """Reserve ``n`` sequences for the current HTTP request, or raise OverloadedError."""
        n = max(1, int(n))
        cfg = self.config
        if self.context.draining:
            self._reject("the server is shutting down; retry the request", "draining")
        engine = self.context.engine
        stats = engine.stats() if engine is not None else None
        if stats is not None and stats.dead:
            raise EngineDeadError("the engine is not running; the server is restarting")
        limits, running = cfg.limits, cfg.scheduler.max_num_seqs
        most = min(c for c in (limits.max_concurrent_requests,
                               running + limits.max_waiting_requests if limits.max_waiting_requests is not None
                               else None, 1 << 62) if c is not None)
        if n > most:  # could never be admitted: a client error, not a reason to retry
            raise InvalidRequestError(f"the request asks for {n} sequences (n / best_of / prompts); this "
                                      f"server admits at most {most} at once", param="n")
        cap = limits.max_concurrent_requests
        if cap is not None and self.in_flight + n > cap:
            self._reject(f"{self.in_flight} requests in flight (limit {cap})", "concurrent")
        if limits.max_waiting_requests is not None:
            queued = stats.waiting if stats is not None else 0
            waiting = max(self.in_flight + n - running, queued + n if queued else 0)
            if waiting > limits.max_waiting_requests:
                self._reject(f"the queue is full (limit {limits.max_waiting_requests} waiting requests)", "waiting")
        if limits.max_waiting_tokens is not None and self.waiting_tokens >= limits.max_waiting_tokens:
            self._reject(f"{self.waiting_tokens} prompt tokens are waiting (limit {limits.max_waiting_tokens})",
                         "waiting_tokens")
        ctx = current_context()
        if ctx is not None and ctx.owner is self and not ctx.closed:
            ctx.sequences += n
            self.in_flight += n

    def rollback(self, ctx: RequestContext, sequences: int) -> None:
        """Give back what ``ctx`` reserved beyond ``sequences`` (a route run again after its
        model loaded reserves again)."""
        extra = ctx.sequences - sequences
        if extra > 0 and ctx.owner is self and not ctx.closed:
            ctx.sequences -= extra
            self.in_flight -= extra

    def _reject(self, why: str, reason: str) -> None:
        self.rejected += 1
        self.context.metrics.rejected(reason)  # llmserve:admission_rejections_total{reason=...}
        log.info("request refused: %s", why)
        raise OverloadedError(f"the server is overloaded: {why}")

    # -- requests -------------------------------------------------------------------------------
    def open(self, ctx: RequestContext) -> None:
        """Start counting ``ctx`` (an HTTP request): its reservations and its deadline, the
        server's ``--request-timeout`` from now."""
        ctx.owner = self
        ctx.deadline = deadline_after(self.config.limits.request_timeout)
        self.requests.add(ctx)
        self.opened += 1

    def close(self, ctx: RequestContext) -> None:
        """Give back everything ``ctx`` reserved (idempotent)."""
        if ctx.closed or ctx.owner is not self:
            return
        self.in_flight -= ctx.sequences
        self.waiting_tokens -= ctx.waiting_tokens
        ctx.closed = True
        self.requests.discard(ctx)
        if ctx.model is not None:  # its model may be unloaded once idle
            self.context.pool.release(ctx.model, ctx.keep_alive)
        if not self.active:
            self._idle.set()

    @property
    def active(self) -> int:
        """Open requests that reserved capacity (generation requests in flight)."""
        return sum(1 for r in self.requests if r.sequences)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False if ``timeout`` ran out first."""
        end = time.monotonic() + timeout
        while self.active:
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return True

