"""What the OpenAPI document says about responses: each route's errors in its dialect's format,
and the event streams of routes that stream.

``build_app`` declares ``4XX`` and ``5XX`` on every route with the owning protocol's
``error_schema`` (an ``anyOf`` of the dialects' schemas on shared routes), which also replaces
FastAPI's own 422 ``HTTPValidationError`` (no dialect answers with that shape). Protocols mark
routes that may answer with Server-Sent Events with ``SSE_RESPONSES`` (``responses=`` of the
route decorator), so the document lists ``text/event-stream`` beside JSON.
"""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute

OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "title": "OpenAIError", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "string", "null"]}}}},
}

# One Server-Sent Event as schema checkers read it.
_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def stream_responses(media_type: str = "text/event-stream") -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that may answer with a stream of ``media_type``."""
    return {200: {"description": f"A JSON body, or a {media_type} stream when streaming",
                  "content": {media_type: {"schema": _EVENT if media_type == "text/event-stream" else
                                           {"type": "string"}}}}}


#: ``responses=`` for a route that answers with Server-Sent Events (always or when asked to).
SSE_RESPONSES = stream_responses()


def error_responses(schemas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``responses`` entries for client and server errors in the given body schemas."""
    unique = [s for i, s in enumerate(schemas) if s not in schemas[:i]]
    schema = unique[0] if len(unique) == 1 else {"anyOf": unique}
    body = {"application/json": {"schema": schema}}
    return {"4XX": {"description": "Client error in the dialect's error format", "content": body},
            "5XX": {"description": "Server error in the dialect's error format", "content": body}}


def declare_errors(route: Any, schemas: list[dict[str, Any]]) -> None:
    """Add the error responses to ``route`` (an ``APIRoute``; others are left alone)."""
    if not isinstance(route, APIRoute):
        return
    for key, value in error_responses(schemas).items():
        route.responses.setdefault(key, value)
