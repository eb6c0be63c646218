"""Pages for people with a browser: the chat playground, Swagger UI and ReDoc.

``GET /`` answers the playground to requests that prefer ``text/html`` (what a browser sends) and
leaves every other request to the dialect that owns ``GET /`` (Ollama's liveness text); the same
page is always at ``/playground``. The pages and their assets are static files, public like the
probes: they hold nothing of the server's, and every API call the pages make carries the key the
user types in (``--api-key``). Swagger UI's and ReDoc's files come from the installed
``fastapi-offline`` package, never from a CDN.
"""

from __future__ import annotations

import html
import importlib.util
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, HTMLResponse, Response

from llmserve import NotFoundError
from llmserve import dialect_router
from llmserve import public_route
from llmserve import answers_media
from llmserve import Protocol

STATIC = Path(__file__).parent / "static"
JS, CSS, PNG = "text/javascript; charset=utf-8", "text/css; charset=utf-8", "image/png"
# name -> (package folder it lives in: "" ours, "ui" the docs UIs' package, media type)
ASSETS = {"playground.js": ("", JS), "playground.css": ("", CSS), "docs.js": ("", JS),
          "swagger-ui-bundle.js": ("ui", JS), "swagger-ui.css": ("ui", CSS), "redoc.standalone.js": ("ui", JS),
          "favicon.png": ("ui", PNG)}
# The pages load nothing from elsewhere, whatever a bundled script would fetch (ReDoc's footer logo):
# the browser itself refuses. Inline styles are allowed: the docs UIs set them from script.
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; font-src 'self' data:; "
       "worker-src 'self' blob:; frame-ancestors 'self'; base-uri 'none'; form-action 'none'")
UI_PACKAGE = "fastapi_offline"  # ships swagger-ui's and redoc's dist files in its static/ folder
_ASSET_RESPONSES = {200: {"description": "The file", "content": {JS.split(";")[0]: {}, CSS.split(";")[0]: {},
                                                                  PNG: {}}}}
_PAGE = {"response_class": HTMLResponse, "responses": {200: {"description": "An HTML page",
                                                              "content": {"text/html": {}}}}}


@lru_cache(maxsize=1)
def ui_folder() -> Path | None:
    """The static folder of the package that ships Swagger UI and ReDoc (found without importing it)."""
    spec = importlib.util.find_spec(UI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if folder.is_dir() else None


@lru_cache(maxsize=4)
def _template(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def render(name: str, request: Request) -> HTMLResponse:
    """A page with the server's root path and OpenAPI URL filled in (the pages' API calls and the
    docs' spec are found from them, so they work behind ``--root-path`` and under a prefix)."""
    root = request.scope.get("root_path", "")
    openapi_url = getattr(request.app, "openapi_url", None) or "/openapi.json"
    text = _template(name).replace("{{root}}", html.escape(root))
    text = text.replace("{{openapi}}", html.escape(root + openapi_url))
    # The same URL answers other clients otherwise (GET /): caches must key on Accept.
    return HTMLResponse(text, headers={"Vary": "Accept", "Cache-Control": "no-cache",
                                       "Content-Security-Policy": CSP})


class WebProtocol(Protocol):
    """The browser pages; errors in the OpenAI format (the pages talk to the OpenAI routes)."""

    def router(self) -> APIRouter:
        router = dialect_router(self, tags=["Web"])

        @router.get("/", include_in_schema=False, **_PAGE)
        @answers_media("text/html")
        @public_route()
        async def home(request: Request) -> Response:
            return render("playground.html", request)

        @router.get("/playground", summary="Web: the chat playground (what GET / shows a browser)", **_PAGE)
        @public_route()
        async def playground(request: Request) -> Response:
            return render("playground.html", request)

        @router.get("/docs", summary="Web: Swagger UI of this document (served locally)", **_PAGE)
        @public_route()
        async def docs(request: Request) -> Response:
            return render("docs.html", request)

        @router.get("/redoc", summary="Web: ReDoc of this document (served locally)", **_PAGE)
        @public_route()
        async def redoc(request: Request) -> Response:
            return render("redoc.html", request)

        @router.get("/assets/{name}", summary="Web: the pages' scripts, styles and icon", response_class=Response,
                    responses=_ASSET_RESPONSES)
        @public_route()
        async def asset(name: str) -> Response:
            return _asset(name)

        return router


def _asset(name: str) -> Response:
    where = ASSETS.get(name)
    if where is None:
        raise NotFoundError(f"no asset named {name[:64]!r}")
    folder = STATIC if where[0] == "" else ui_folder()
    if folder is None or not (folder / name).is_file():
        raise NotFoundError(f"{name} is not installed: the API docs need the {UI_PACKAGE.replace('_', '-')} "
                            "package (pip install fastapi-offline)")
    return FileResponse(folder / name, media_type=where[1], headers={"Cache-Control": "no-cache"})
