"""Health routes: 200 with an empty body while the engine is alive, 503 once it is not."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from llmserve.protocol import Protocol


class OpsProtocol(Protocol):
    def _health(self) -> Response:
        engine = self.context.engine
        if engine is not None and getattr(engine, "is_dead", False):
            return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)
        return Response(status_code=200)

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/health", include_in_schema=True)
        async def health() -> Response:
            return self._health()

        @router.get("/ping")
        async def ping() -> Response:
            return self._health()

        @router.post("/ping")
        async def ping_post() -> Response:
            return self._health()

        return router
