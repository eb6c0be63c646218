"""The OpenAI protocol: routes, request-id echo and the OpenAI error envelope."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve.protocol import Protocol
from llmserve.server.errors import openai_error_response

from .chat import Chat
from .completions import Completions
from .wire import ChatCompletionRequest, CompletionRequest


class OpenAIProtocol(Protocol):
    def _model_card(self, name: str) -> dict[str, Any]:
        info = self.context.model
        return {"id": name, "object": "model", "created": 0, "owned_by": "llmserve",
                "root": info.path if info else name, "parent": None,
                "max_model_len": info.max_model_len if info else None}

    def router(self) -> APIRouter:
        router = APIRouter()
        chat, completions = Chat(self), Completions(self)

        def with_id(request: Request, response: Response) -> Response:
            rid = request.headers.get("x-request-id")
            if rid:
                response.headers["X-Request-Id"] = rid
            return response

        @router.post("/v1/chat/completions")
        async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
            return with_id(request, await chat(body, request.headers.get("x-request-id")))

        @router.post("/v1/completions")
        async def create_completion(body: CompletionRequest, request: Request) -> Response:
            return with_id(request, await completions(body, request.headers.get("x-request-id")))

        @router.get("/v1/models")
        async def list_models() -> JSONResponse:
            return JSONResponse({"object": "list",
                                 "data": [self._model_card(n) for n in self.context.served_model_names]})

        @router.get("/v1/models/{model_id:path}")
        async def get_model(model_id: str) -> JSONResponse:
            return JSONResponse(self._model_card(self.context.check_model(model_id)))

        @router.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": __version__})

        return router

    def error_response(self, error: Any, request: Request | None) -> Response:
        headers = {"x-should-retry": "false"} if error.status < 500 and error.status != 429 else {}
        response = openai_error_response(error, headers)
        if request is not None and request.headers.get("x-request-id"):
            response.headers["X-Request-Id"] = request.headers["x-request-id"]
        return response
