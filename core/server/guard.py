"""The request guard: one ASGI wrapper that gives every HTTP request its scope and notices
when the client goes away.

It is pure ASGI on purpose: a ``BaseHTTPMiddleware`` would hide ``http.disconnect`` from
the routes. For each HTTP request it

- opens a ``RequestScope`` (admission reservation, deadline) and closes it when the
  response has ended, whatever happened, so capacity is always given back;
- once the request body has been read, waits for ``http.disconnect`` in the background and,
  if the client leaves before the response is complete, cancels the route. Cancelling
  reaches the engine client's ``generate()``, whose ``finally`` aborts the request, so its
  KV blocks are freed at the engine's next command poll (before its next step). That covers
  non-streaming routes too, which would otherwise await the whole result for nobody.
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmserve.request_context import reset_scope, set_scope


class RequestGuard:
    """``app.add_middleware(RequestGuard, context=context)``."""

    def __init__(self, app: Any, context: Any) -> None:
        self.app = app
        self.context = context

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = self.context.admission
        rscope = admission.open()
        token = set_scope(rscope)
        try:
            await self._serve(scope, receive, send)
        finally:
            reset_scope(token)
            admission.close(rscope)

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
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

        async def guarded_receive() -> dict:
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

        async def guarded_send(message: dict) -> None:
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
