"""HTTP guards in front of every dialect: API keys, body size, content type, CORS, request log.

Written as plain ASGI (not Starlette's ``BaseHTTPMiddleware``, which runs the app in a
separate task and hides ``http.disconnect`` from it), so handlers still see a client go away
and abort its generation. Refusals are rendered by the protocol that owns the route, in its
own error format, exactly as errors raised inside the route would be.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.routing import compile_path

from llmserve import request_log
from llmserve.errors import ConfigError, InvalidRequestError, LLMServeError, PayloadTooLargeError, UnauthorizedError
from llmserve.server.errors import openai_error_response

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmserve.server.context import ServerContext

access_log = logging.getLogger("llmserve.access")
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
F = TypeVar("F", bound=Callable[..., Any])

PUBLIC_ATTR = "__llmserve_public__"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Media types a route may receive: JSON, and raw bytes (Triton's binary tensor extension).
# The route still parses and validates the body; this only turns away forms and text early.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def public_route(kind: str = "always") -> Callable[[F], F]:
    """Mark an endpoint as reachable without an API key.

    ``"always"``: liveness and readiness probes. ``"metrics"``: only with ``--public-metrics``.
    """

    def mark(endpoint: F) -> F:
        setattr(endpoint, PUBLIC_ATTR, kind)
        return endpoint

    return mark


def _json_media(content_type: str) -> bool:
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


class ServerMiddleware:
    """Authenticates, bounds and content-checks each HTTP request, then logs one line for it."""

    def __init__(self, app: Any, fastapi_app: "FastAPI", context: "ServerContext") -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        self.context = context
        config = context.config
        self.keys = [k.encode("utf-8", "surrogateescape") for k in config.api_key]
        self.public_metrics = bool(config.public_metrics)
        self.limit = int(config.max_request_body_bytes)
        self._table: list[tuple[Any, set[str], Any, str]] | None = None

    # -- routing ---------------------------------------------------------------------------------
    def _routes(self) -> list[tuple[Any, set[str], Any, str]]:
        """(compiled path, methods, endpoint, path template) of every dialect route, built once."""
        if self._table is None:
            table = getattr(self.fastapi_app.state, "route_table", [])
            self._table = [(compile_path(path)[0], methods, endpoint, path) for path, methods, endpoint in table]
        return self._table

    def _match(self, scope: Scope) -> tuple[str | None, Any]:
        """(path template, endpoint) that will serve ``scope``; a path match with the wrong method counts
        (the route answers 405 in its dialect)."""
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # behind a proxy mounted under a prefix (--root-path)
            path = path[len(root):] or "/"
        partial: tuple[str | None, Any] = (None, None)
        for regex, methods, endpoint, template in self._routes():
            if regex.match(path):
                if scope["method"] in methods or (scope["method"] == "HEAD" and "GET" in methods):
                    return template, endpoint
                if partial[0] is None:
                    partial = (template, endpoint)
        return partial

    def _is_public(self, endpoint: Any, method: str) -> bool:
        kind = getattr(endpoint, PUBLIC_ATTR, None)
        methods = next((m for _, m, e, _ in self._routes() if e is endpoint), set())
        if kind is None or method not in methods:
            return False
        return kind == "always" or (kind == "metrics" and self.public_metrics)

    async def _refuse(self, error: LLMServeError, scope: Scope, endpoint: Any, send: Send,
                      headers: dict[str, str] | None = None) -> None:
        owner = getattr(self.fastapi_app.state, "owners", {}).get(endpoint)
        request = Request(scope)
        response = owner.error_response(error, request) if owner is not None else openai_error_response(error)
        for name, value in (headers or {}).items():
            response.headers[name] = value
        await response(scope, _no_body, send)

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = Request(scope).headers
        given_id = headers.get("x-request-id", "")
        record = request_log.RequestRecord(given_id if _REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex)
        token = request_log.current.set(record)
        route, endpoint = self._match(scope)
        state = {"status": None, "too_large": False}

        async def send_status(message: Message) -> None:
            if state["too_large"]:
                return  # the body overflowed: whatever the app answers is replaced by a 413
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, send_status, route, endpoint, headers, state)
        finally:
            request_log.current.reset(token)
            self._log(scope, route, endpoint, record, state["status"], time.monotonic() - started)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, route: Any, endpoint: Any,
                     headers: Any, state: dict[str, Any]) -> None:
        method = scope["method"]
        if self.keys and not self._is_public(endpoint, method):
            if not key_matches(presented_key(headers), self.keys):
                await self._refuse(UnauthorizedError("Invalid or missing API key; send it as "
                                                     "'Authorization: Bearer KEY' or 'X-Api-Key: KEY'"),
                                   scope, endpoint, send, {"WWW-Authenticate": "Bearer"})
                return
        length = headers.get("content-length")
        declared = int(length) if length and length.isdigit() else None
        if declared is not None and declared > self.limit:
            await self._refuse(self._too_large(), scope, endpoint, send, {"Connection": "close"})
            return
        content_type = headers.get("content-type")
        if method in BODY_METHODS and content_type is not None and declared != 0 and not _json_media(content_type):
            media = content_type.split(";", 1)[0].strip()[:64]
            await self._refuse(InvalidRequestError(f"Content-Type '{media}' is not supported: send the body as "
                                                   "application/json"), scope, endpoint, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # a chunked upload without (or lying about) Content-Length
                    state["too_large"] = True
                    raise self._too_large()
            return message

        try:
            await self.app(scope, bounded_receive, send)
        except Exception:
            if not state["too_large"]:
                raise
        if state["too_large"] and state["status"] is None:
            state["too_large"] = False  # let our own answer through
            await self._refuse(self._too_large(), scope, endpoint, send, {"Connection": "close"})

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"request body is larger than the server's limit of {self.limit} bytes "
                                    "(--max-request-body-bytes)")

    def _log(self, scope: Scope, route: Any, endpoint: Any, record: request_log.RequestRecord,
             status: int | None, seconds: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        owner = getattr(self.fastapi_app.state, "owners", {}).get(endpoint)
        protocols = getattr(self.fastapi_app.state, "protocols", {})
        dialect = next((name for name, p in protocols.items() if p is owner), "-")
        path = route or "-"  # the route template: no ids or names from the URL
        ttft = f"{record.ttft:.3f}s" if record.ttft is not None else "-"
        access_log.info("request_id=%s engine_id=%s dialect=%s route=\"%s %s\" status=%s prompt_tokens=%d "
                        "completion_tokens=%d ttft=%s total=%.3fs", record.request_id, record.engine_id or "-",
                        dialect, scope["method"], path, status if status is not None else "-",
                        record.prompt_tokens, record.completion_tokens, ttft, seconds)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def install(app: "FastAPI", context: "ServerContext") -> None:
    """Add the guards (and CORS when configured) to ``app``. Raises ConfigError on unsafe CORS."""
    config = context.config
    origins = list(config.cors_allow_origins)
    if config.cors_allow_credentials and "*" in origins:
        raise ConfigError("--cors-allow-credentials cannot be combined with --cors-allow-origins '*': "
                          "list the origins allowed to send credentials")
    if config.cors_allow_credentials and not origins:
        raise ConfigError("--cors-allow-credentials needs --cors-allow-origins (the origins allowed to send them)")
    app.add_middleware(ServerMiddleware, fastapi_app=app, context=context)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it runs first: preflights are answered before the API-key check
        # (browsers send them without credentials) and refusals still carry CORS headers.
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=config.cors_allow_credentials,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)
