"""The dialect kit: the plumbing every protocol package shares, so each dialect holds only
its own wire format (models, parameter rules, reply shapes, error format).

- ``WireModel``: the base of every request model (one policy for extras, nulls, NaN).
- ``dumps`` / ``sse`` / ``SSE_DONE``: one JSON encoding and one Server-Sent Events framing.
- ``dialect_router``: a router whose routes render every error with the protocol's
  ``error_response`` right where it happens; ``in_band_errors`` does the same for a stream
  whose 200 has already gone, with the protocol's ``error_body``.
- ``load_json`` / ``parse_model`` / ``parse_body``: strict parsing for routes that read their
  body by hand (compressed bodies, binary tensors, bodies told apart by shape);
  ``scan_top_level`` reads a body's top-level keys without building it.
- ``check_json``: the rules every JSON body meets, whichever way it was parsed (no nesting past
  ``MAX_JSON_DEPTH``, no lone UTF-16 surrogates); ``DialectRoute`` applies them to bodies
  FastAPI validates, ``load_json`` to bodies read by hand.
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncGenerator, AsyncIterator, Callable, ClassVar, Coroutine, Protocol, TypeVar, cast

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute, request_response
from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, ValidationError
from pydantic_core import CoreSchema
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Scope

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.server.errors import field_error, to_error
from llmserve.server.negotiation import wanted
from llmserve.server.pool import run_routed

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


#: Integers no field can hold, whatever its own range (beyond any 64-bit value, so that a dialect
#: range check still words its own error for, say, a seed of 2**64).
INT_MIN, INT_MAX = -(10**20), 10**20
_SCALARS = frozenset({"int", "float", "bool"})
_SKIP = frozenset({"metadata", "serialization", "ref", "cls", "custom_error_context"})


def _strict_scalars(schema: Any, in_keys: bool = False) -> Any:
    """A copy of a pydantic core schema whose int, float and bool values are strict (no "10" or
    true for an int, no "yes" or 1 for a bool; an int still fills a float) and whose ints are
    bounded to 64 bits. Dict keys stay lax: JSON object keys are always strings."""
    if isinstance(schema, list):
        return [_strict_scalars(item, in_keys) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _SKIP else _strict_scalars(v, k == "keys_schema") for k, v in schema.items()}
    kind = out.get("type")  # a dict when this is a model's fields and one of them is named "type"
    if isinstance(kind, str) and kind in _SCALARS and not in_keys:
        out["strict"] = True
    if kind == "int":
        if "le" not in out and "lt" not in out:
            out["le"] = INT_MAX
        if "ge" not in out and "gt" not in out:
            out["ge"] = INT_MIN
    return out


class WireModel(BaseModel):
    """Base of request models: unknown fields are ignored (real clients send other servers'
    extras), explicit nulls mean "default" (declare fields ``X | None = None``), and NaN or
    Infinity, which Python's json module accepts but JSON does not have, are refused with an
    error naming the field instead of reaching a sampler or a range check.

    Numbers and booleans are strict, as OpenAI's API answers them: ``"max_tokens": "10"``,
    ``"max_tokens": true`` and ``"stream": "yes"`` are errors naming the field, not coerced;
    an integer never exceeds 64 bits even where its field declares no range."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: type[BaseModel], handler: GetCoreSchemaHandler) -> CoreSchema:
        return cast(CoreSchema, _strict_scalars(handler(source)))


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
    A route marked with ``negotiation.answers_media`` matches only the requests that prefer its
    media type.
    """

    protocol: ClassVar[ErrorFormat | None] = None

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if not wanted(scope, self.endpoint):
            return Match.NONE, {}
        return super().matches(scope)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        protocol = self.protocol
        json_body = self.body_field is not None

        async def guarded(request: Request) -> Response:
            try:
                if json_body:
                    await _parse_json_body(request)
                context = getattr(request.app.state, "context", None)
                if context is None or not context.pool.several:
                    return await handler(request)
                return await run_routed(context, lambda: handler(request))
            except Exception as exc:  # every error leaves in the dialect's format
                if protocol is None:
                    raise
                return render_error(protocol, exc, request)

        return guarded


async def _parse_json_body(request: Request) -> None:
    """Parse a JSON body with ``load_json`` before FastAPI does, so that its rules (nesting,
    surrogates) hold for validated bodies too: FastAPI then reuses the parsed value."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        raw = await request.body()
        if raw.strip():
            request._json = load_json(raw)  # what Request.json() caches and returns


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


# -- the rules of every JSON body -------------------------------------------------------------
#: Deepest nesting of arrays and objects a request may hold. Real bodies (a tool's JSON schema
#: inside ``tools`` included) stay far below it; past it, code that walks the value
#: recursively (validation, schema compilers, templates) could exhaust the stack.
MAX_JSON_DEPTH = 128
# A lone surrogate can only come from a \uD800-\uDFFF escape or from the bytes ED A0-BF (which
# json decodes with "surrogatepass"): bodies without either are not walked for it.
_SURROGATE_HINT = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class NestingTooDeepError(MalformedBodyError):
    """A JSON value nested deeper than ``MAX_JSON_DEPTH`` (a body, or JSON text in a field)."""


def _where(entry: tuple[Any, ...] | None) -> list[str]:
    path: list[str] = []
    while entry is not None and entry[3] is not None:
        path.append(str(entry[3]))
        entry = entry[2]
    return path[::-1]


def check_json(value: Any, raw: bytes | None = None, prefix: str = "") -> None:
    """Refuse a parsed JSON value nested past ``MAX_JSON_DEPTH`` or holding a lone UTF-16
    surrogate (which no UTF-8 text can carry: it would fail later, in a tokenizer or in the
    reply). ``raw``, the text it was parsed from, lets a body that cannot break a rule skip the
    walk; ``prefix`` names where the value sits. Errors name the field: for nesting its
    top-level key, for a surrogate the full path."""
    deep = raw is None or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = raw is None or _SURROGATE_HINT.search(raw) is not None
    if not (deep or surrogates):
        return
    # (value, depth, parent entry, key): an explicit stack, since the value may be deeper
    # than Python's recursion limit allows a recursive walk to go.
    stack: list[tuple[Any, int, Any, Any]] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        node, depth = entry[0], entry[1]
        if isinstance(node, str):
            if surrogates and _SURROGATE.search(node):
                _lone_surrogate(_where(entry), prefix)
            continue
        if isinstance(node, dict):
            if surrogates and any(_SURROGATE.search(key) for key in node):
                _lone_surrogate(_where(entry) + ["(key)"], prefix)
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            top = ([prefix] if prefix else []) + _where(entry)[:1]
            where = f" (in `{top[0]}`)" if top else ""
            raise NestingTooDeepError(f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels){where}",
                                      param=".".join(top) or None)
        for key, child in items:
            if isinstance(child, (str, dict, list)):
                stack.append((child, depth + 1, entry, key))


def _lone_surrogate(path: list[str], prefix: str) -> None:
    param = ".".join(([prefix] if prefix else []) + path) or None
    where = f"{param}: " if param else ""
    raise InvalidRequestError(f"{where}text contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                              f"valid Unicode text", param=param)


# -- request bodies parsed by hand ------------------------------------------------------------
def load_json(raw: bytes) -> Any:
    """The parsed body (None when empty), checked by ``check_json``; a body that is not JSON
    is a MalformedBodyError."""
    try:
        value = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        raise MalformedBodyError("request body is not valid JSON") from None
    except RecursionError:
        deep = scan_top_level(raw)[1]  # too deep to build: name the field from the text
        where = f" (in `{deep}`)" if deep else ""
        raise NestingTooDeepError(f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels){where}",
                                  param=deep) from None
    check_json(value, raw)
    return value


# A JSON string (escapes included), or a character that opens, closes or separates.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]:]')


def scan_top_level(raw: bytes) -> tuple[list[str], str | None]:
    """The keys of the top-level JSON object in ``raw``, in order, and the first one whose value
    nests past ``MAX_JSON_DEPTH`` (None if none does), read from the text without building any
    value: a body too deep for ``json`` still says whose it is and where it is too deep. Best
    effort: text that is not a JSON object gives no keys."""
    if not raw.lstrip().startswith(b"{"):
        return [], None
    keys: list[str] = []
    deep: str | None = None
    depth, last = 0, b""
    for match in _TOKEN.finditer(raw):
        token = match.group()
        if token in (b"{", b"["):
            depth += 1
            if depth > MAX_JSON_DEPTH and deep is None and keys:
                deep = keys[-1]
        elif token in (b"}", b"]"):
            depth -= 1
            if depth <= 0:
                break  # the end of the top-level object
        elif token == b":" and depth == 1 and last.startswith(b'"'):
            try:
                keys.append(json.loads(last))
            except ValueError:
                keys.append("")  # a key that is not valid text names nothing
        last = token
    return keys, deep


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
