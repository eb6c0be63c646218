"""The one per-HTTP-request context: its id, admission share, server deadline and log counts.

The server's request guard (``llmserve.server.guard``) opens one ``RequestContext`` per HTTP
request and makes it current in the only context variable the server keeps, so code deep
inside a dialect's handler, and the engine client's ``generate()``, find it without every
dialect passing it along. Tasks created while handling the request (streaming bodies,
``generate_many``'s helpers) copy the context and see the same object. Outside HTTP (tests,
offline use) there is none and every user treats that as "no limits, nothing to record".
Only numbers and ids go in: never prompts, outputs or headers.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmserve.outputs import RequestOutput


class CapacityOwner(Protocol):
    """The totals a request's share feeds (the server's admission controller)."""

    waiting_tokens: int

_current: ContextVar["RequestContext | None"] = ContextVar("llmserve_request_context", default=None)


@dataclass(eq=False)
class RequestContext:
    """One HTTP request as the server tracks it.

    ``deadline`` (``time.monotonic()``) is the server's ``--request-timeout`` for this
    request; the engine client enforces it together with ``GenerateRequest.deadline``.
    ``sequences`` / ``waiting_tokens`` are this request's share of the admission totals:
    ``owner`` (the admission controller, once it registered the request) is told about every
    change, so its totals are always the sum over open requests. The remaining fields feed
    the one-line request log.
    """

    request_id: str
    started: float                      # time.monotonic() when the request arrived
    deadline: float | None = None
    sequences: int = 0                  # reserved by admission checks
    waiting_tokens: int = 0             # prompt tokens submitted but not yet prefilled
    owner: "CapacityOwner | None" = None
    closed: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None           # seconds from engine arrival to the first token
    engine_id: str | None = None        # the first engine request id seen
    warnings: list[str] = field(default_factory=list)  # sent as X-Llmserve-Warning (ASCII, no user text)
    # The model the request was routed to (a ``llmserve.server.pool.ModelSlot``, leased until the
    # request closes) and how long it may then stay loaded idle (Ollama's keep_alive, seconds).
    model: Any = None
    keep_alive: float | None = None

    def add_waiting_tokens(self, count: int) -> None:
        if self.closed or count <= 0:
            return
        self.waiting_tokens += count
        if self.owner is not None:
            self.owner.waiting_tokens += count

    def remove_waiting_tokens(self, count: int) -> None:
        count = min(count, self.waiting_tokens)
        if self.closed or count <= 0:
            return
        self.waiting_tokens -= count
        if self.owner is not None:
            self.owner.waiting_tokens -= count

    def note_output(self, out: "RequestOutput") -> None:
        """Add a finished generation's token counts and time to first token."""
        self.prompt_tokens += out.usage.prompt_tokens
        self.completion_tokens += out.usage.completion_tokens
        if self.engine_id is None:
            self.engine_id = out.request_id
        t = out.timings
        if t.first_token is not None and t.arrival:
            ttft = t.first_token - t.arrival
            self.ttft = ttft if self.ttft is None else min(self.ttft, ttft)


def current_context() -> RequestContext | None:
    """The context of the HTTP request being served, or None outside of one."""
    return _current.get()


def set_context(context: RequestContext | None) -> Token:
    """Make ``context`` current; returns the token for ``reset_context``."""
    return _current.set(context)


def reset_context(token: Token) -> None:
    _current.reset(token)
