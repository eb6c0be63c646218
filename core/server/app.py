"""``build_app``: mount every enabled protocol's router and map errors per dialect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute

from llmserve import __version__
from llmserve.errors import ConfigError, LLMServeError, NotFoundError
from llmserve.server.dialect_kit import adopt_routes
from llmserve.server.errors import openai_error_response, to_error
from llmserve.server.guard import install as install_guard
from llmserve.server.negotiation import media_of
from llmserve.server.openapi import OPENAI_ERROR_SCHEMA, declare_errors
from llmserve.server.shared import mount_shared
from llmserve.server.startup import LoadingGate

if TYPE_CHECKING:
    from llmserve.server.protocol import Protocol
    from llmserve.server.context import ServerContext


def _claims(route: BaseRoute, prefix: str) -> list[tuple[str, str, str]]:
    """(method, path, media type) claimed by ``route``; the media type is "" but for a negotiated
    route (``negotiation.answers_media``), which may share its method and path with one plain route."""
    path = prefix + getattr(route, "path", "")
    methods = getattr(route, "methods", None) or {"WEBSOCKET"}
    media = media_of(getattr(route, "endpoint", None)) or ""
    return [(m, path, media) for m in sorted(methods) if m != "HEAD"]


def _split_negotiated(router: APIRouter) -> APIRouter | None:
    """Move ``router``'s negotiated routes to a router of their own (None if it has none): it is
    included before every other, so they are tried before the plain route they share a path with."""
    negotiated = [r for r in router.routes if media_of(getattr(r, "endpoint", None))]
    if not negotiated:
        return None
    router.routes[:] = [r for r in router.routes if not media_of(getattr(r, "endpoint", None))]
    return APIRouter(routes=negotiated)


def build_app(context: "ServerContext", protocols: "dict[str, Protocol]", lifespan: Any = None) -> FastAPI:
    """Assemble the FastAPI app from enabled protocols (name -> instance).

    Raises ConfigError when two protocols claim the same method and path.
    """
    app = FastAPI(title="llmserve", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.context = context
    owners: dict[object, "Protocol"] = {}   # route endpoint -> protocol that owns it
    claimed: dict[tuple[str, str, str], str] = {}
    shared_groups: dict[tuple[str, str], list] = {}
    table: list[tuple[str, set[str], object]] = []  # (path, methods, endpoint) for the middleware
    leading: list[tuple[APIRouter, str]] = []   # negotiated routes, included first
    included: list[tuple[APIRouter, str]] = []
    for name, protocol in protocols.items():
        prefix = context.config.http.protocol_prefix.get(name, "").rstrip("/")
        router = protocol.router()
        adopt_routes(protocol, router)  # one error path for every route, plain APIRouters' included
        for route in router.routes:
            declare_errors(route, [protocol.error_schema or OPENAI_ERROR_SCHEMA])
            for claim in _claims(route, prefix):
                if claim in claimed:
                    method, path, media = claim
                    raise ConfigError(
                        f"{method} {path}{f' ({media})' if media else ''} is claimed by both protocol "
                        f"'{claimed[claim]}' and protocol "
                        f"'{name}'; serve only one (--protocols) or mount one under a prefix "
                        f"(--protocol-prefix {name}=/{name})"
                    )
                claimed[claim] = name
            endpoint = getattr(route, "endpoint", None)
            if endpoint is not None:
                owners[endpoint] = protocol
                methods = set(getattr(route, "methods", None) or ())
                table.append((prefix + getattr(route, "path", ""), methods, endpoint))
        front = _split_negotiated(router)
        if front is not None:
            leading.append((front, prefix))
        included.append((router, prefix))
        for shared in protocol.shared_routes():
            shared_groups.setdefault((shared.method.upper(), prefix + shared.path), []).append((protocol, shared))
    for router, prefix in leading + included:
        app.include_router(router, prefix=prefix)
    table.sort(key=lambda entry: media_of(entry[2]) is None)  # the order the router tries them in
    for (method, path), entries in shared_groups.items():
        if (method, path, "") in claimed:
            raise ConfigError(f"{method} {path} is a shared route of {entries[0][0].__class__.__name__} but protocol "
                              f"'{claimed[(method, path, '')]}' also claims it outright")
        shared_router = APIRouter()
        shared_endpoint = mount_shared(shared_router, method, path, entries)
        for route in shared_router.routes:
            declare_errors(route, [p.error_schema or OPENAI_ERROR_SCHEMA for p, _ in entries])
        owners[shared_endpoint] = entries[0][0]
        table.append((path, {method}, shared_endpoint))
        app.include_router(shared_router)
    _add_schemas(app, [s.body_schema for group in shared_groups.values() for _, s in group if s.body_schema])
    app.state.owners = owners
    app.state.route_table = table
    app.state.protocols = protocols

    # An unrouted path answers in the format of the dialect whose routes share its longest
    # fixed prefix ("/v2/models/x/nope" -> KServe), else OpenAI's.
    families = sorted(((path.split("{")[0], owners[endpoint]) for path, _, endpoint in table
                       if endpoint in owners and len(path.split("{")[0]) > 1), key=lambda f: -len(f[0]))

    def render(request: Request, exc: BaseException) -> Response:
        error = to_error(exc)
        owner = owners.get(request.scope.get("endpoint"))
        if owner is None:
            path = request.url.path
            owner = next((p for prefix, p in families if path.startswith(prefix) and
                          (prefix.endswith("/") or path[len(prefix):len(prefix) + 1] in ("", "/"))), None)
        if owner is None:
            return openai_error_response(error)
        return owner.error_response(error, request)

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 404 and request.scope.get("endpoint") is None:
            exc = NotFoundError(f"no route {request.method} {request.url.path}")
        return render(request, exc)

    # Handlers for specific classes answer and stop; the one for Exception (Starlette's last
    # resort) answers too but re-raises, so uvicorn logs it and drops the connection: core
    # errors must never take that path.
    for exc_type in (LLMServeError, HTTPException, RequestValidationError, ValueError, TypeError, KeyError,
                     Exception):
        app.add_exception_handler(exc_type, on_error)
    # Inside the guard: while the model loads, routes that need it answer 503 in their dialect.
    app.add_middleware(LoadingGate, fastapi_app=app, context=context)
    # The one request middleware (request context, API keys, body limit, admission, abort on
    # disconnect, request log) and CORS; raises on unsafe CORS.
    install_guard(app, context)
    return app


def _add_schemas(app: FastAPI, models: list[Any]) -> None:
    """Put shared routes' body models into the OpenAPI components they reference."""
    if not models:
        return
    from pydantic.json_schema import models_json_schema

    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
