"""The dialect kit: the plumbing every protocol package shares, so each dialect holds only
its own wire format (models, parameter rules, reply shapes, error format).

- ``WireModel``: the base of every request model (one policy for extras, nulls, NaN).
- ``dumps`` / ``sse`` / ``SSE_DONE``: one JSON encoding and one Server-Sent Events framing.
- ``dialect_router``: a router whose routes render every error with the protocol's
  ``error_response`` right where it happens; ``in_band_errors`` does the same for a stream
  whose 200 has already gone, with the protocol's ``error_body``.
- ``load_json`` / ``parse_model`` / ``parse_body``: strict parsing for routes that read their
  body by hand (compressed bodies, binary tensors, bodies told apart by shape).
"""

from __future__ import annotations

import json
from typing import Any, AsyncGenerator, AsyncIterator, Callable, ClassVar, Coroutine, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute, request_response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import Response

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.server.errors import field_error, to_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

#: Headers of every streamed reply: no caching, and no buffering in nginx-style proxies.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: The OpenAI family's end-of-stream event.
SSE_DONE = "data: [DONE]\n\n"


class ErrorFormat(Protocol):
    """What the kit needs of a dialect: its error format (``llmserve.server.protocol.Protocol``
    has both methods; typed structurally so that the kit does not import the base class)."""

    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]: ...

    def error_response(self, error: LLMServeError, request: Request | None) -> Response: ...


class WireModel(BaseModel):
    """Base of request models: unknown fields are ignored (real clients send other servers'
    extras), explicit nulls mean "default" (declare fields ``X | None = None``), and NaN or
    Infinity, which Python's json module accepts but JSON does not have, are refused with an
    error naming the field instead of reaching a sampler or a range check."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class MalformedBodyError(InvalidRequestError):
    """The body is not JSON, or not a JSON object (as opposed to a field with a bad value)."""


class UnsupportedError(LLMServeError):
    """A feature the dialect defines but this server does not implement. A 400, not a 501:
    the request asks for something this server cannot do, and retrying it will not help
    (Triton answers such requests with 400 too)."""

    status = 400
    type = "unsupported"


# -- encoding ---------------------------------------------------------------------------------
def dumps(obj: Any) -> str:
    """Compact JSON, UTF-8 as is; NaN/Infinity raise (clients' JSON parsers reject them, so
    replies map non-finite numbers to the dialect's stand-in before encoding)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any, event: str | None = None) -> str:
    """One Server-Sent Event carrying ``obj`` as JSON, with an ``event:`` name when given."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {dumps(obj)}\n\n"


# -- errors -----------------------------------------------------------------------------------
def render_error(protocol: ErrorFormat, exc: BaseException, request: Request | None) -> Response:
    """Any exception raised while serving ``protocol``'s route, as its error response."""
    return protocol.error_response(to_error(exc), request)


class DialectRoute(APIRoute):
    """An ``APIRoute`` that renders its errors itself, with its protocol's ``error_response``.

    Left to the app-wide handlers, an exception that is not an HTTPException reaches
    Starlette's ServerErrorMiddleware, which sends the error response but then re-raises:
    uvicorn logs a traceback and closes the keep-alive connection, so a client with a
    connection pool (tritonclient, openai) fails its next call. Request validation errors are
    caught here too, so every error of the route takes this one path.
    """

    protocol: ClassVar[ErrorFormat | None] = None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        protocol = self.protocol

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # every error leaves in the dialect's format
                if protocol is None:
                    raise
                return render_error(protocol, exc, request)

        return guarded


def _route_class(protocol: ErrorFormat) -> type[DialectRoute]:
    return type(f"{type(protocol).__name__}Route", (DialectRoute,), {"protocol": protocol})


def dialect_router(protocol: ErrorFormat, **kwargs: Any) -> APIRouter:
    """An ``APIRouter`` (same arguments) whose routes render errors with ``protocol``."""
    return APIRouter(route_class=_route_class(protocol), **kwargs)


def adopt_routes(protocol: ErrorFormat, router: APIRouter) -> None:
    """Give every plain ``APIRoute`` of ``router`` the dialect's error path, as if it had been made
    by ``dialect_router``: ``build_app`` calls it on every protocol's router, so a plugin that
    built a plain ``APIRouter`` cannot leak a traceback or drop a connection either."""
    route_class = _route_class(protocol)
    for route in router.routes:
        if isinstance(route, APIRoute) and not isinstance(route, DialectRoute):
            route.__class__ = route_class  # same fields; only the handler differs
            route.app = request_response(route.get_route_handler())


async def in_band_errors(protocol: ErrorFormat, source: AsyncGenerator[T, None],
                         frame: Callable[[Any], T]) -> AsyncIterator[T]:
    """Relay a streamed reply; an exception after the 200 becomes its last item: the
    protocol's ``error_body`` put in the stream's framing by ``frame`` (e.g. ``sse``)."""
    try:
        async for item in source:
            yield item
    except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
        yield frame(protocol.error_body(to_error(exc))[1])
    finally:
        await source.aclose()  # now, not at garbage collection: closing aborts the engine request


# -- request bodies parsed by hand ------------------------------------------------------------
def load_json(raw: bytes) -> Any:
    """The parsed body (None when empty); a body that is not JSON is a MalformedBodyError."""
    try:
        return json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        raise MalformedBodyError("request body is not valid JSON") from None
    except RecursionError:
        raise MalformedBodyError("request body is nested too deeply") from None


def parse_model(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate ``data`` (a parsed JSON value) as ``model``; errors name the field, with the
    same wording as bodies FastAPI validates (``prefix`` names where ``data`` sits)."""
    if not isinstance(data, dict):
        if prefix:
            raise InvalidRequestError(f"{prefix}: must be a JSON object", param=prefix)
        raise MalformedBodyError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise field_error(exc.errors(include_url=False), prefix) from None


def parse_body(model: type[M], raw: bytes) -> M:
    """``parse_model`` over a raw request body."""
    return parse_model(model, load_json(raw))
