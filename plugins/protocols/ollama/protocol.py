"""The Ollama protocol: the routes Ollama's clients call, and Ollama's error format
(``{"error": "..."}`` with Ollama's status codes).

``GET|HEAD /`` answers "Ollama is running" (clients probe it); ``POST /`` is TGI's. The
model-management routes (pull, push, create, copy, delete, blobs) are the source of most
Ollama advisories (arbitrary file writes through crafted digests, heap reads through crafted
GGUF files); this server never writes models over HTTP, so they answer 403 in Ollama's format
without reading their bodies or touching the disk. The one exception is ``/api/pull`` on a
server started with ``--allow-pull`` (and API keys): it fetches a Hugging Face repo id, never a
path or a registry manifest, through the same code as ``llmserve pull``.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from llmserve import __version__
from llmserve import LLMServeError
from llmserve import InvalidRequestError
from llmserve import STREAM_HEADERS, dumps, in_band_errors
from llmserve import progress
from llmserve import dialect_router
from llmserve import stream_responses
from llmserve import Protocol

from .embed import Embeddings
from .generation import NDJSON, Generation
from .models import ModelCard
from .params import listed_name, resolve_model
from .wire import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ManagementRequest, ModelRequest

RUNNING = "Ollama is running"
MANAGEMENT = ("this server does not manage models over HTTP ({what} is disabled): it serves the models it was "
              "started with (--model, --models-dir, --serve-cached-models); /api/pull works on a server started "
              "with --allow-pull")
NDJSON_RESPONSES = stream_responses(NDJSON)
_HEAD_OK = {200: {"description": "The resource exists (no body)"}}
# Model management: (method, path, what is refused). Never touches the disk.
MANAGEMENT_ROUTES = (("POST", "/api/pull", "pulling models"), ("POST", "/api/push", "pushing models"),
                     ("POST", "/api/create", "creating models"), ("POST", "/api/copy", "copying models"),
                     ("DELETE", "/api/delete", "deleting models"))

#: The Ollama version ``/api/version`` reports: the API this dialect follows. Clients gate
#: features on it (``codex --oss`` refuses an "Ollama 0.1.0" as too old), so it names a release
#: whose API the dialect serves, not llmserve's own version (which rides beside it).
OLLAMA_API_VERSION = "0.20.0"


PULL_STATUS_INTERVAL_S = 1.0


def _line(obj: Any) -> str:
    return dumps(obj) + "\n"


async def _pull_lines(task: Any) -> AsyncIterator[str]:
    """Ollama's pull progress, NDJSON: a status line per second (what the download is doing, as
    ``/ready`` says it), then ``success``."""
    yield _line({"status": "pulling manifest"})
    try:
        while not task.done():
            await asyncio.wait([task], timeout=PULL_STATUS_INTERVAL_S)
            phase = progress.reporter().current()
            if not task.done() and phase is not None:
                yield _line({"status": phase.describe()})
        slot = task.result()
    finally:
        task.cancel()  # the client left: the download thread finishes on its own, nobody waits
    yield _line({"status": "success", "model": listed_name(slot.name)})


class Forbidden(LLMServeError):
    status = 403
    type = "permission_error"


def error_body(error: LLMServeError) -> tuple[int, dict[str, Any]]:
    """A core error in Ollama's format: ``{"error": message}`` with the error's status (400 bad
    input, 401 key, 403 refused, 404 unknown model, 413 too large, 429/503 busy)."""
    return error.status, {"error": error.message}


class OllamaProtocol(Protocol):
    """Ollama's native API (``/api/*``)."""

    error_schema = {"title": "OllamaError", "type": "object", "required": ["error"],
                    "properties": {"error": {"type": "string"}}}

    def __init__(self, context: Any, options: Any = None) -> None:
        super().__init__(context, options)
        self.card = ModelCard(context)  # the current request's model
        self._cards: dict[int, ModelCard] = {}
        self.generation = Generation(self)
        self.embeddings = Embeddings(self)

    def cards(self) -> list[ModelCard]:
        """A card for every model the server serves (the default one first)."""
        slots = self.context.pool.slots
        return [self._cards.setdefault(id(slot), ModelCard(self.context, slot)) for slot in slots]

    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]:
        return error_body(error)

    def router(self) -> APIRouter:
        router = dialect_router(self, tags=["Ollama"])
        self._info_routes(router)
        generation, embeddings = self.generation, self.embeddings

        @router.post("/api/chat", responses=NDJSON_RESPONSES, summary="Ollama: chat (NDJSON stream by default)")
        async def chat(body: ChatRequest, request: Request) -> Response:
            self.context.admission.check(1)  # before any templating or tokenizing
            return await generation.chat(body, request.headers.get("x-request-id"))

        @router.post("/api/generate", responses=NDJSON_RESPONSES,
                     summary="Ollama: completion (NDJSON stream by default)")
        async def generate(body: GenerateRequest, request: Request) -> Response:
            self.context.admission.check(1)
            return await generation.generate(body, request.headers.get("x-request-id"))

        @router.post("/api/embed", summary="Ollama: embeddings (needs --task embed)")
        async def embed(body: EmbedRequest) -> Response:
            return await embeddings.embed(body)

        @router.post("/api/embeddings", summary="Ollama: one embedding (legacy; needs --task embed)")
        async def embeddings_legacy(body: EmbeddingsRequest) -> Response:
            return await embeddings.embeddings(body)

        self._management_routes(router)
        return router

    def _info_routes(self, router: APIRouter) -> None:
        card = self.card

        async def running() -> Response:
            return PlainTextResponse(RUNNING)

        async def version() -> Response:
            return JSONResponse({"version": OLLAMA_API_VERSION, "llmserve": __version__})

        async def tags() -> Response:
            return JSONResponse({"models": [e for c in self.cards() for e in c.tags()]})

        for path, endpoint, summary, kind in (
                ("/", running, "Ollama: liveness probe of Ollama clients", PlainTextResponse),
                ("/api/version", version, "Ollama: server version", JSONResponse),
                ("/api/tags", tags, "Ollama: the served model(s)", JSONResponse)):
            # GET and HEAD as two operations: one route with both would give both one operation id.
            router.add_api_route(path, endpoint, methods=["GET"], summary=summary, response_class=kind)
            router.add_api_route(path, endpoint, methods=["HEAD"], summary=summary, response_class=kind,
                                 operation_id=f"{endpoint.__name__}_head")

        @router.get("/api/ps", summary="Ollama: loaded models")
        async def ps() -> Response:
            return JSONResponse({"models": [e for c in self.cards() if c.slot.engine is not None for e in c.ps()]})

        @router.post("/api/show", summary="Ollama: model details, template and capabilities")
        async def show(body: ModelRequest) -> Response:
            resolve_model(self.context, body.model or body.name)
            return JSONResponse(card.show())

    def _pull_route(self, refused: Any) -> Any:
        async def pull(body: ManagementRequest | None = None) -> Response:
            if not self.context.config.router.allow_pull:
                return await refused(body)
            text = (body.model or body.name or "") if body is not None else ""
            if not text:
                raise InvalidRequestError("model is required", param="model")
            task = asyncio.ensure_future(asyncio.to_thread(self.context.pull_model, text))
            if body is not None and body.stream is False:
                slot = await task
                return JSONResponse({"status": "success", "model": listed_name(slot.name)})
            return StreamingResponse(in_band_errors(self, _pull_lines(task), _line), media_type=NDJSON,
                                     headers=STREAM_HEADERS)
        return pull

    def _management_routes(self, router: APIRouter) -> None:
        def refuse(what: str) -> Forbidden:
            return Forbidden(MANAGEMENT.format(what=what))

        # Bodies are declared for the OpenAPI document only: nothing in them is used.
        def refusing(what: str) -> Any:
            async def refused(body: ManagementRequest | None = None) -> Response:
                raise refuse(what)
            return refused

        for method, path, what in MANAGEMENT_ROUTES:
            name = path.rsplit("/", 1)[1]
            if path == "/api/pull":
                router.add_api_route(path, self._pull_route(refusing(what)), methods=[method], name=name,
                                     summary="Ollama: pull a Hugging Face model (--allow-pull; refused otherwise)",
                                     operation_id=f"ollama_{name}", responses=NDJSON_RESPONSES)
                continue
            router.add_api_route(path, refusing(what), methods=[method], summary=f"Ollama: refused ({what})",
                                 operation_id=f"ollama_{name}", name=name)

        async def blobs(digest: str) -> Response:
            raise refuse("uploading blobs")

        for method in ("HEAD", "POST"):
            router.add_api_route("/api/blobs/{digest}", blobs, methods=[method], responses=_HEAD_OK,
                                 summary="Ollama: refused (no blob store)", operation_id=f"blobs_{method.lower()}")
