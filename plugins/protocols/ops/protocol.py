"""Operations routes: liveness (/health, /ping), readiness (/ready) and Prometheus /metrics.

/health and /ping answer 200 while the process is alive, the model loading included (503 once
the engine died), and never need an API key; /ready also says whether the server should get
traffic (503 "loading" until the model is loaded, "draining" on shutdown); /metrics needs a key
unless the server runs with --public-metrics. All of them answer while the model loads.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, PlainTextResponse, Response

from llmserve import progress
from llmserve import dialect_router
from llmserve import CONTENT_TYPE
from llmserve import public_route
from llmserve import Protocol


class OpsProtocol(Protocol):
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
        ctx = self.context
        text = ctx.metrics.render(ctx.model_name, ctx.engine.stats() if ctx.engine is not None else None)
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

        return router
