"""The request guard: the one ASGI middleware every HTTP request passes through.

For each HTTP request it

- opens the request's ``RequestContext`` (id, admission share, deadline, log counts) and
  makes it current: the only per-request context variable the server has. Its id is the
  client's ``X-Request-Id`` when that is a plain token, else a new one; the route sees that id
  in the header, and with ``--enable-request-id-headers`` every reply carries it back (without
  it no reply carries the header, whatever the route set: vLLM's behaviour);
- runs the checks of ``llmserve.server.middleware`` (API key on the routed path, deny by
  default, body size, content type) and answers refusals in the route's dialect, before the
  request can hold any capacity; serves HEAD as GET for routes that declare only GET;
- bounds the body while the route reads it: 413 past ``--max-request-body-bytes``, 408 past
  ``--timeout-request-body``;
- registers the context with admission control and gives its reservation back when the
  response has ended, whatever happened;
- once the request body has been read, waits for ``http.disconnect`` in the background and,
  if the client leaves before the response is complete, cancels the route. Cancelling
  reaches the engine client's ``generate()``, whose ``finally`` aborts the request, so its
  KV blocks are freed at the engine's next command poll (before its next step). That covers
  non-streaming routes too, which would otherwise await the whole result for nobody. The
  route is cancelled once, so nothing on its path may swallow that ``CancelledError``: on
  Python 3.10 and 3.11 ``asyncio.wait_for`` does when the awaited result lands in the same
  turns (the engine client's deadlines avoid it);
- writes the one-line request log (``llmserve.access``): ids, route, status, token counts,
  time to first token and total time; never prompts, outputs or headers.

WebSocket upgrades need a key as well. Limits that apply before a request reaches the app
(header size and count, the time to send them) are in ``llmserve.server.edge``.

It is pure ASGI on purpose: Starlette's ``BaseHTTPMiddleware`` runs the app in a separate task
and would hide ``http.disconnect`` from it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from llmserve.errors import ConfigError
from llmserve.request_context import RequestContext, reset_context, set_context
from llmserve.server.middleware import Checks

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmserve.server.context import ServerContext

access_log = logging.getLogger("llmserve.access")
# A client's X-Request-Id is used (logged, echoed, given to the route) only when it is 1-128
# visible ASCII characters other than quotes and backslashes: nothing that can split or forge a log line.
_REQUEST_ID = re.compile(r"[!#-&(-\[\]-~]{1,128}")


class RequestGuard:
    """``app.add_middleware(RequestGuard, fastapi_app=app, context=context)`` (``install()`` does)."""

    def __init__(self, app: Any, fastapi_app: "FastAPI", context: "ServerContext") -> None:
        self.app = app
        self.context = context
        self.checks = Checks(fastapi_app, context.config)
        self.echo_id = bool(context.config.http.enable_request_id_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not self.checks.websocket_allowed(Headers(scope=scope)):
            # Deny by default reaches WebSocket routes too (a dialect may add one): closing before
            # accepting makes the server answer the upgrade with 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given_id = headers.get("x-request-id", "")
        ctx = RequestContext(given_id if _REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex, time.monotonic())
        token = set_context(ctx)
        route, endpoint = self.checks.match(scope)
        method = scope["method"]
        scope = _app_scope(scope, ctx.request_id, self.checks.head_as_get(scope, endpoint))
        state: dict[str, Any] = {"status": None, "refused": None}
        request_id = [(b"x-request-id", ctx.request_id.encode("ascii"))] if self.echo_id else []

        async def send_status(message: Message) -> None:
            if state["refused"] is not None:
                return  # the body overflowed or stalled: what the app answers is replaced by our 413 / 408
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                # The reply names its request (the client's id when it is a plain token, else ours) when the
                # server was asked to; a route's own header never goes out unchecked.
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                warnings = [(b"x-llmserve-warning", w.encode("ascii")) for w in ctx.warnings]
                message = {**message, "headers": [*kept, *request_id, *warnings]}
            await send(message)

        try:
            refusal = self.checks.refusal(scope, headers, endpoint)
            if refusal is not None:
                await self.checks.refuse(*refusal, scope, endpoint, send_status)
                return
            admission = self.context.admission
            admission.open(ctx)
            try:
                await self._bounded(scope, receive, send_status, endpoint, state)
            finally:
                admission.close(ctx)
        finally:
            reset_context(token)
            self._log(method, route, endpoint, ctx, state["status"], time.monotonic() - ctx.started)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, endpoint: Any,
                       state: dict[str, Any]) -> None:
        """Serve the request; answer 413 if its body turns out larger than the limit, 408 if it
        does not arrive within ``--timeout-request-body`` (a client trickling it in)."""
        limit, received = self.checks.limit, 0
        deadline = asyncio.get_running_loop().time() + self.checks.body_timeout
        body_open = True

        async def bounded_receive() -> Message:
            nonlocal received, body_open
            if not body_open:  # past the body: what is left to receive is the disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                state["refused"] = (self.checks.too_slow(), {"Connection": "close"})
                raise self.checks.too_slow() from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_open = False
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked upload without (or lying about) Content-Length
                    state["refused"] = (self.checks.too_large(), {})  # the rest is dropped (edge.py)
                    raise self.checks.too_large()
            return message

        try:
            await self._watched(scope, bounded_receive, send)
        except Exception:
            if state["refused"] is None:
                raise
        refused, state["refused"] = state["refused"], None  # let our own answer through
        if refused is not None and state["status"] is None:
            error, extra = refused
            await self.checks.refuse(error, extra, scope, endpoint, send)

    async def _watched(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; cancel it if the client disconnects before the response is complete."""
        gone = asyncio.Event()
        state = {"body_done": False, "complete": False, "cancelled": False}
        tasks: dict[str, asyncio.Task] = {}

        async def watch() -> None:
            # After the body, the server's next message is http.disconnect: sent when the client
            # leaves, or (uvicorn) once the response is complete. Only the first case cancels.
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            gone.set()
            app_task = tasks.get("app")
            if not state["complete"] and app_task is not None and not app_task.done():
                state["cancelled"] = True
                app_task.cancel()

        async def guarded_receive() -> Message:
            if state["body_done"]:  # the watcher owns the channel now; relay what it saw
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif message["type"] == "http.request" and not message.get("more_body", False):
                state["body_done"] = True
                tasks["watch"] = asyncio.create_task(watch())
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        app_task = tasks["app"] = asyncio.create_task(self.app(scope, guarded_receive, guarded_send))
        try:
            await app_task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if state["cancelled"] and not (current and current.cancelling()):
                return  # the client left and its request was aborted: nothing to answer
            raise
        finally:
            watcher = tasks.get("watch")
            if watcher is not None:
                watcher.cancel()

    def _log(self, method: str, route: str | None, endpoint: Any, ctx: RequestContext, status: int | None,
             seconds: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        path = route or "-"  # the route template: no ids or names from the URL
        ttft = f"{ctx.ttft:.3f}s" if ctx.ttft is not None else "-"
        access_log.info("request_id=%s engine_id=%s dialect=%s route=\"%s %s\" status=%s prompt_tokens=%d "
                        "completion_tokens=%d ttft=%s total=%.3fs", ctx.request_id, ctx.engine_id or "-",
                        self.checks.dialect(endpoint), method, path, status if status is not None else "-",
                        ctx.prompt_tokens, ctx.completion_tokens, ttft, seconds)


def _app_scope(scope: Scope, request_id: str, head_as_get: bool) -> Scope:
    """The scope the route sees: ``X-Request-Id`` replaced by the request's id (so a dialect that
    echoes or reuses the header gets the sanitised or generated one), and HEAD served as GET where
    the route has no HEAD of its own (the server sends no body for a HEAD request)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
    headers.append((b"x-request-id", request_id.encode("ascii")))
    # Changed in place, so that what the router records in the scope (the endpoint) stays visible
    # to the error handler outside this middleware; only HEAD needs a copy: the server itself reads
    # the method from its own scope to leave out the body.
    scope["headers"] = headers
    return {**scope, "method": "GET"} if head_as_get else scope


def install(app: "FastAPI", context: "ServerContext") -> None:
    """Add the request guard (and CORS when configured) to ``app``. Raises ConfigError on unsafe CORS."""
    config = context.config
    origins = list(config.http.cors_allow_origins)
    if config.http.cors_allow_credentials and "*" in origins:
        raise ConfigError("--cors-allow-credentials cannot be combined with --cors-allow-origins '*': "
                          "list the origins allowed to send credentials")
    if config.http.cors_allow_credentials and not origins:
        raise ConfigError("--cors-allow-credentials needs --cors-allow-origins (the origins allowed to send them)")
    app.add_middleware(RequestGuard, fastapi_app=app, context=context)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it runs first: preflights are answered before the API-key check
        # (browsers send them without credentials) and refusals still carry CORS headers.
        http = config.http
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=http.cors_allow_credentials,
                           allow_methods=list(http.cors_allow_methods), allow_headers=list(http.cors_allow_headers),
                           expose_headers=["X-Request-Id", "Retry-After", "X-Llmserve-Warning"], max_age=600)
