"""Operations routes: liveness (/health, /ping), readiness (/ready), Prometheus /metrics, and
loading and unloading models (/models/load, /models/unload, llama.cpp's router-mode routes).

/health and /ping answer 200 while the process is alive, the model loading included (503 once
the engine died), and never need an API key; /ready also says whether the server should get
traffic (503 "loading" until the model is loaded, "draining" on shutdown); /metrics needs a key
unless the server runs with --public-metrics. All of them answer while the model loads. The
model routes need a key like every other route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, PlainTextResponse, Response

from llmserve import progress
from llmserve import InvalidRequestError
from llmserve import NotFoundError
from llmserve import dialect_router
from llmserve import CONTENT_TYPE
from llmserve import merge_scrapes
from llmserve import public_route
from llmserve import Protocol


class ModelAction(BaseModel):
    """The body of ``/models/load`` and ``/models/unload``: the model's served name."""

    model: str = Field(min_length=1, max_length=1024)


class OpsProtocol(Protocol):
    def _slot(self, name: str) -> Any:
        slot = self.context.pool.find(name)
        if slot is None:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        return slot

    async def _load(self, body: ModelAction) -> Response:
        slot = self._slot(body.model)
        await self.context.pool.ensure(slot)
        return JSONResponse({"success": True, "model": slot.name, "loaded": True})

    async def _unload(self, body: ModelAction) -> Response:
        slot = self._slot(body.model)
        if slot.pinned:
            raise InvalidRequestError(f"`{slot.name}` is the server's default model: it stays loaded", param="model")
        if slot.leases:  # unloaded as soon as its last request ends
            slot.keep_alive = 0.0
            return JSONResponse({"success": True, "model": slot.name, "loaded": True, "requests": slot.leases})
        await self.context.pool.unload(slot)
        return JSONResponse({"success": True, "model": slot.name, "loaded": False})

    def _health(self) -> Response:
        engine = self.context.engine
        if engine is not None and engine.is_dead:
            return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)
        return Response(status_code=200)

    def _ready(self) -> Response:
        reason = self.context.readiness()
        if reason is not None:
            body = {"status": "not ready", "reason": reason}
            phase = progress.reporter().current() if reason == "loading" else None
            if phase is not None:  # what the load is doing now, as the start-up log says it
                body["progress"] = phase.describe()
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready"}, status_code=200)

    def _metrics(self) -> Response:
        # One model_name per model: the default one always, the others while loaded.
        slots = [s for s in self.context.pool.slots if s.pinned or s.engine is not None]
        text = merge_scrapes([s.metrics.render(s.name, s.engine.stats() if s.engine is not None else None)
                              for s in slots])
        return Response(text, media_type=CONTENT_TYPE)

    def router(self) -> APIRouter:
        router = dialect_router(self)
        # Liveness answers 200 with an empty body (what load balancers and vLLM clients expect).
        HEALTH = {200: {"description": "Alive (empty body)"}}

        @router.get("/health", response_class=Response, responses=HEALTH)
        @public_route()
        async def health() -> Response:
            return self._health()

        @router.get("/ping", response_class=Response, responses=HEALTH)
        @public_route()
        async def ping() -> Response:
            return self._health()

        @router.post("/ping", response_class=Response, responses=HEALTH)
        @public_route()
        async def ping_post() -> Response:
            return self._health()

        @router.get("/ready")
        @public_route()
        async def ready() -> Response:
            return self._ready()

        @router.get("/metrics", response_class=PlainTextResponse)
        @public_route("metrics")
        async def metrics() -> Response:
            return self._metrics()

        @router.post("/models/load", summary="Load a model now (it would load on its first request)")
        async def load_model(body: ModelAction) -> Response:
            return await self._load(body)

        @router.post("/models/unload", summary="Unload a model loaded on demand (once its requests end)")
        async def unload_model(body: ModelAction) -> Response:
            return await self._unload(body)

        return router
