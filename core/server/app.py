"""``build_app``: mount every enabled protocol's router and map errors per dialect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute

from llmserve import __version__
from llmserve.errors import ConfigError, NotFoundError
from llmserve.server.errors import openai_error_response, to_error

if TYPE_CHECKING:
    from llmserve.protocol import Protocol
    from llmserve.server.context import ServerContext


def _claims(route: BaseRoute, prefix: str) -> list[tuple[str, str]]:
    path = prefix + getattr(route, "path", "")
    methods = getattr(route, "methods", None) or {"WEBSOCKET"}
    return [(m, path) for m in sorted(methods) if m != "HEAD"]


def build_app(context: "ServerContext", protocols: "dict[str, Protocol]", lifespan: Any = None) -> FastAPI:
    """Assemble the FastAPI app from enabled protocols (name -> instance).

    Raises ConfigError when two protocols claim the same method and path.
    """
    app = FastAPI(title="llmserve", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.context = context
    owners: dict[object, "Protocol"] = {}   # route endpoint -> protocol that owns it
    claimed: dict[tuple[str, str], str] = {}
    for name, protocol in protocols.items():
        prefix = context.config.protocol_prefix.get(name, "").rstrip("/")
        router = protocol.router()
        for route in router.routes:
            for claim in _claims(route, prefix):
                if claim in claimed:
                    method, path = claim
                    raise ConfigError(
                        f"{method} {path} is claimed by both protocol '{claimed[claim]}' and protocol "
                        f"'{name}'; serve only one (--protocols) or mount one under a prefix "
                        f"(--protocol-prefix {name}=/{name})"
                    )
                claimed[claim] = name
            endpoint = getattr(route, "endpoint", None)
            if endpoint is not None:
                owners[endpoint] = protocol
        app.include_router(router, prefix=prefix)
    app.state.owners = owners
    app.state.protocols = protocols

    def render(request: Request, exc: BaseException) -> Response:
        error = to_error(exc)
        owner = owners.get(request.scope.get("endpoint"))
        if owner is None:
            return openai_error_response(error)
        return owner.error_response(error, request)

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 404 and request.scope.get("endpoint") is None:
            exc = NotFoundError(f"no route {request.method} {request.url.path}")
        return render(request, exc)

    for exc_type in (Exception, HTTPException, RequestValidationError):
        app.add_exception_handler(exc_type, on_error)
    return app
