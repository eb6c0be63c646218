"""Per-HTTP-request state shared by the server and the engine client.

The server opens one ``RequestScope`` per HTTP request (``llmserve.server.guard``) and
makes it current in a context variable, so code deep inside a dialect's handler, and the
engine client's ``generate()``, can find it without every dialect passing it along. It
carries the request's admission reservation (sequences and prompt tokens waiting for their
prefill) and its server-wide deadline. Tasks created while handling the request (streaming
bodies, ``generate_many``'s helpers) copy the context and see the same scope.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

_current: ContextVar["RequestScope | None"] = ContextVar("llmserve_request_scope", default=None)


@dataclass(eq=False)
class RequestScope:
    """One HTTP request's share of the server's capacity.

    ``owner`` is the admission controller whose totals this scope feeds (or None); it is
    told about every change so that its totals are always the sum over open scopes.
    """

    started: float
    deadline: float | None = None
    sequences: int = 0          # reserved by admission checks
    waiting_tokens: int = 0     # prompt tokens submitted but not yet prefilled
    owner: Any = None
    closed: bool = False

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


def current_scope() -> RequestScope | None:
    """The scope of the HTTP request being served, or None outside of one."""
    return _current.get()


def set_scope(scope: RequestScope | None) -> Any:
    """Make ``scope`` current; returns the token for ``reset_scope``."""
    return _current.set(scope)


def reset_scope(token: Any) -> None:
    _current.reset(token)
