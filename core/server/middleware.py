"""The checks in front of every dialect: API keys, body size, content type.

Keys are checked against the route a request will reach (the same match the router makes on
the decoded path), never against the URL or the Host header, and every route not marked with
``public_route`` needs one: deny by default, for every dialect and any method.

``llmserve.server.guard.RequestGuard``, the one request middleware, runs them before any
route. Refusals are rendered by the protocol that owns the route, in its own error format, exactly
as errors raised inside the route would be.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any, Callable, TypeVar
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import Message, Scope, Send

from llmserve.errors import (InvalidRequestError, LLMServeError, PayloadTooLargeError, RequestTimeoutError,
                             UnauthorizedError)
from llmserve.server.errors import openai_error_response
from llmserve.server.negotiation import wanted

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmserve.config import ServerConfig

F = TypeVar("F", bound=Callable[..., Any])

PUBLIC_ATTR = "__llmserve_public__"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def public_route(kind: str = "always") -> Callable[[F], F]:
    """Mark an endpoint as reachable without an API key.

    ``"always"``: liveness and readiness probes. ``"metrics"``: only with ``--public-metrics``.
    """

    def mark(endpoint: F) -> F:
        setattr(endpoint, PUBLIC_ATTR, kind)
        return endpoint

    return mark


def _json_media(content_type: str) -> bool:
    # Media types a route may receive: JSON, and raw bytes (Triton's binary tensor extension).
    # The route still parses and validates the body; this only turns away forms and text early.
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json", "application/octet-stream") or (
        media.startswith("application/") and media.endswith("+json"))


def presented_key(headers: Any) -> str | None:
    """The key a client sent: ``Authorization: Bearer KEY`` first, else ``X-Api-Key: KEY``."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def key_matches(candidate: str | None, keys: list[bytes]) -> bool:
    """Constant-time check against every key (no early exit, so timing reveals nothing)."""
    given = (candidate or "").encode("utf-8", "surrogateescape")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok and candidate is not None


class Checks:
    """The checks every HTTP request passes before its route runs, and the refusals they give.

    Used by ``RequestGuard`` (``llmserve.server.guard``), the one middleware: it asks
    ``refusal()`` first and answers with ``refuse()``, in the format of the protocol that owns
    the route, exactly as errors raised inside the route would be.
    """

    def __init__(self, fastapi_app: "FastAPI", config: "ServerConfig") -> None:
        self.fastapi_app = fastapi_app
        self.keys = [k.encode("utf-8", "surrogateescape") for k in config.http.api_key]
        self.public_metrics = bool(config.http.public_metrics)
        self.limit = int(config.http.max_request_body_bytes)
        self.body_timeout = float(config.http.timeout_request_body)
        self._table: list[tuple[Any, set[str], Any, str]] | None = None

    # -- routing ---------------------------------------------------------------------------------
    def _routes(self) -> list[tuple[Any, set[str], Any, str]]:
        """(compiled path, methods, endpoint, path template) of every dialect route, built once."""
        if self._table is None:
            table = getattr(self.fastapi_app.state, "route_table", [])
            self._table = [(compile_path(path)[0], methods, endpoint, path) for path, methods, endpoint in table]
        return self._table

    def match(self, scope: Scope) -> tuple[str | None, Any]:
        """(path template, endpoint) that will serve ``scope``; a path match with the wrong method counts
        (the route answers 405 in its dialect)."""
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # behind a proxy mounted under a prefix (--root-path)
            path = path[len(root):] or "/"
        partial: tuple[str | None, Any] = (None, None)
        for regex, methods, endpoint, template in self._routes():
            if regex.match(path) and wanted(scope, endpoint):  # a negotiated route only for its media type
                if scope["method"] in methods or (scope["method"] == "HEAD" and "GET" in methods):
                    return template, endpoint
                if partial[0] is None:
                    partial = (template, endpoint)
        return partial

    def _methods(self, endpoint: Any) -> set[str]:
        return next((m for _, m, e, _ in self._routes() if e is endpoint), set())

    def head_as_get(self, scope: Scope, endpoint: Any) -> bool:
        """Whether ``scope`` is a HEAD request for a route that serves GET but declares no HEAD
        (FastAPI routes do not add it): it is then served, and checked, as that GET."""
        methods = self._methods(endpoint)
        return scope["method"] == "HEAD" and "HEAD" not in methods and "GET" in methods

    def _is_public(self, endpoint: Any, method: str) -> bool:
        kind = getattr(endpoint, PUBLIC_ATTR, None)
        methods = self._methods(endpoint)
        if method == "HEAD" and "HEAD" not in methods:
            method = "GET"  # HEAD answers like GET, key or no key
        if kind is None or method not in methods:
            return False
        return kind == "always" or (kind == "metrics" and self.public_metrics)

    def dialect(self, endpoint: Any) -> str:
        """The name of the protocol that owns ``endpoint`` ("-" if none does)."""
        owner = getattr(self.fastapi_app.state, "owners", {}).get(endpoint)
        protocols = getattr(self.fastapi_app.state, "protocols", {})
        return next((name for name, p in protocols.items() if p is owner), "-")

    # -- checks ----------------------------------------------------------------------------------
    def websocket_allowed(self, headers: Any) -> bool:
        """A WebSocket upgrade needs a key like any route (none is public)."""
        return not self.keys or key_matches(presented_key(headers), self.keys)

    def refusal(self, scope: Scope, headers: Any, endpoint: Any) -> tuple[LLMServeError, dict[str, str]] | None:
        """Why the request must not reach its route (error, extra headers), or None to let it in."""
        method = scope["method"]
        if self.keys and not self._is_public(endpoint, method):
            if not key_matches(presented_key(headers), self.keys):
                return (UnauthorizedError("Invalid or missing API key; send it as 'Authorization: Bearer KEY' "
                                          "or 'X-Api-Key: KEY'"), {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        declared = int(length) if length and length.isdigit() else None
        if declared is not None and declared > self.limit:
            # No "Connection: close": the connection reads and drops the body after the answer
            # (llmserve.server.edge), so a client that sends its whole body first still reads it.
            return self.too_large(), {}
        content_type = headers.get("content-type")
        if method in BODY_METHODS and content_type is not None and declared != 0 and not _json_media(content_type):
            media = content_type.split(";", 1)[0].strip()[:64]
            return InvalidRequestError(f"Content-Type '{media}' is not supported: send the body as "
                                       "application/json"), {}
        return None

    def too_slow(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"the request body did not arrive within {self.body_timeout:g} s "
                                   "(--timeout-request-body)")

    def too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"request body is larger than the server's limit of {self.limit} bytes "
                                    "(--max-request-body-bytes)")

    def error_response(self, error: LLMServeError, endpoint: Any, request: Request | None) -> Response:
        """``error`` in the format of the protocol that owns ``endpoint`` (the OpenAI envelope when none does)."""
        owner = getattr(self.fastapi_app.state, "owners", {}).get(endpoint)
        return owner.error_response(error, request) if owner is not None else openai_error_response(error)

    async def refuse(self, error: LLMServeError, headers: dict[str, str], scope: Scope, endpoint: Any,
                     send: Send) -> None:
        """Answer ``error`` in the format of the protocol that owns ``endpoint``."""
        response = self.error_response(error, endpoint, Request(scope))
        for name, value in headers.items():
            response.headers[name] = value
        await response(scope, _no_body, send)


def head_refusals(fastapi_app: "FastAPI",
                  config: "ServerConfig") -> Callable[[str, bytes, int, str], tuple[bytes, bytes]]:
    """What the HTTP edge (``llmserve.server.edge``) sends when it refuses a request head:
    ``answer(method, target, status, message) -> (content type, body)``, in the format of the
    dialect whose route the request line names (``target`` as far as it arrived; ``method`` empty
    when unknown), so that a client parses the refusal as it parses every other error of the route."""
    checks = Checks(fastapi_app, config)

    def answer(method: str, target: bytes, status: int, message: str) -> tuple[bytes, bytes]:
        path = unquote(target.split(b"?", 1)[0].decode("latin-1"))
        scope = {"type": "http", "method": method, "path": path, "root_path": config.http.root_path, "headers": []}
        _, endpoint = checks.match(scope)
        error = RequestTimeoutError(message) if status == 408 else InvalidRequestError(message, status=status)
        response = checks.error_response(error, endpoint, None)
        return response.headers.get("content-type", "application/json").encode("latin-1"), bytes(response.body)

    return answer


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
