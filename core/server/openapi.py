"""What the OpenAPI document says about responses: each route's errors in its dialect's format,
and the event streams of routes that stream.

``build_app`` declares ``4XX`` and ``5XX`` on every route with the owning protocol's
``error_schema`` (an ``anyOf`` of the dialects' schemas on shared routes), which also replaces
FastAPI's own 422 ``HTTPValidationError`` (no dialect answers with that shape). Protocols mark
routes that may answer with Server-Sent Events with ``SSE_RESPONSES`` (``responses=`` of the
route decorator), so the document lists ``text/event-stream`` beside JSON. Routes that read
their body by hand declare it with ``openapi_body``.
"""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute
from pydantic import BaseModel

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


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with every ``$ref`` inlined (wire models are not recursive),
    usable directly in an OpenAPI ``requestBody``."""
    schema = model.model_json_schema()
    return _inline(schema, schema.get("$defs", {}))


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def openapi_body(model: type[BaseModel], extra_content: dict[str, Any] | None = None) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body for a route that parses its body by
    hand (FastAPI documents only the bodies it validates itself); ``extra_content`` adds
    other media types (``{media type: OpenAPI media object}``)."""
    content: dict[str, Any] = {"application/json": {"schema": inline_schema(model)}, **(extra_content or {})}
    return {"requestBody": {"required": True, "content": content}}
