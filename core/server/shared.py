"""Routes that several dialects serve, told apart by the JSON body.

``POST /generate`` is TGI's when the body has ``inputs`` and vLLM-native when it has
``prompt``; ``POST /tokenize`` is TGI's or vLLM's the same way. Each protocol declares its
half as a ``SharedRoute``; ``build_app`` mounts one dispatcher per method and path that
parses the body once and hands it to the first protocol that accepts it. A body that breaks
the JSON rules (not JSON, nested too deeply, a lone surrogate) is refused by the dialect its
top-level keys name, found by a scan that does not build the value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from llmserve.errors import InvalidRequestError
from llmserve.server.dialect_kit import ErrorFormat, load_json, render_error, scan_top_level
from llmserve.server.openapi import stream_responses
from llmserve.server.pool import run_routed


@dataclass
class SharedRoute:
    """One dialect's half of a shared route.

    ``accepts(body)`` says whether this dialect handles a parsed JSON body; ``handler``
    serves it. ``describe`` names the body shape in the error shown when no dialect accepts
    a body (e.g. "a TGI body with `inputs`"). ``body_schema`` (a pydantic model) documents
    the body in the OpenAPI document; ``stream_media_type`` is the
    media type of its streamed answers, if it streams.
    """

    method: str
    path: str
    accepts: Callable[[Any], bool]
    handler: Callable[[Request, Any], Awaitable[Response]]
    describe: str = ""
    body_schema: Any = None
    stream_media_type: str | None = None  # set when the route may answer with a stream


def mount_shared(router: APIRouter, method: str, path: str,
                 entries: Sequence[tuple[ErrorFormat, SharedRoute]]) -> Callable[..., Any]:
    """Add the dispatcher for one shared route to ``router``; return its endpoint."""

    async def dispatch(request: Request) -> Response:
        first = entries[0][0]
        raw = await request.body()
        try:
            body = load_json(raw)
        except InvalidRequestError as exc:
            # The value could not be built (or must not be used), yet its keys still say whose it is: a vLLM
            # body with a lone surrogate gets vLLM's error, not the first dialect's.
            keys = dict.fromkeys(scan_top_level(raw)[0])
            owner = next((p for p, route in entries if route.accepts(keys)), first)
            return owner.error_response(exc, request)
        body = {} if body is None else body  # an empty body is an empty object, which no dialect claims
        for protocol, route in entries:
            if route.accepts(body):
                try:
                    context = request.app.state.context
                    if not context.pool.several:
                        return await route.handler(request, body)
                    return await run_routed(context, functools.partial(route.handler, request, body))
                except Exception as exc:  # noqa: BLE001 - rendered in the chosen dialect's format
                    return render_error(protocol, exc, request)
        shapes = "; or ".join(r.describe for _, r in entries if r.describe)
        return first.error_response(InvalidRequestError(f"request body not understood: expected {shapes}"), request)

    schemas = [r.body_schema for _, r in entries if r.body_schema is not None]
    extra = None
    if schemas:
        refs = [{"$ref": f"#/components/schemas/{s.__name__}"} for s in schemas]
        extra = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}}
    dispatch.__name__ = "shared_" + path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    responses: dict = {}
    for _, r in entries:
        if r.stream_media_type:
            for status, value in stream_responses(r.stream_media_type).items():
                responses.setdefault(status, {"description": value["description"], "content": {}})
                responses[status]["content"].update(value["content"])
    router.add_api_route(path, dispatch, methods=[method], openapi_extra=extra, responses=responses or None,
                         summary=" / ".join(p.__class__.__name__ for p, _ in entries))
    return dispatch
