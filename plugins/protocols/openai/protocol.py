"""The OpenAI protocol: routes (chat and completions in ``chat.py`` and ``completions.py``,
embeddings/score/rerank in ``pooling.py``, tokenizer routes in ``tokens.py``), request-id echo
and the OpenAI error envelope."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve import LLMServeError
from llmserve import dialect_router, parse_model
from llmserve import SSE_RESPONSES
from llmserve import Protocol
from llmserve import SharedRoute

from .chat import Chat
from .completions import Completions
from .pooling import EmbeddingRequest, Pooling, RerankRequest, ScoreRequest
from .tokens import DetokenizeRequest, TokenizeRequest, Tokens, accepts_tokenize
from .wire import ChatCompletionRequest, CompletionRequest


def sequences(body: Any) -> int:
    """Sequences one prompt of ``body`` generates (n, or best_of when larger), for admission."""
    return max(body.n or 1, body.best_of or 1, 1)


def prompt_count(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: a list of strings or of token lists is a batch."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


class OpenAIProtocol(Protocol):
    named_error_codes = True  # context_length_exceeded, as OpenAI's API names it

    def _model_card(self, name: str, slot: Any = None) -> dict[str, Any]:
        """A ``/v1/models`` entry; the context length under vLLM's name and OpenRouter's, which
        agent clients read to size their prompts. With several models each says whether it is
        loaded (``loaded``, and llama.cpp's router ``status``); one not loaded yet gives the
        context length it was configured with, if any. What it takes and gives is OpenRouter's
        ``architecture`` (``input_modalities``: the slot's, text until images are served)."""
        slot = slot or self.context.slot
        info = slot.model
        length = info.max_model_len if info else slot.config.llm.max_model_len
        task = info.task if info else slot.config.llm.task
        card = {"id": name, "object": "model", "created": 0, "owned_by": "llmserve",
                "root": info.path if info else (slot.source or name), "parent": None,
                "max_model_len": length, "context_length": length,
                "architecture": {"input_modalities": slot.input_modalities,
                                 "output_modalities": ["embeddings" if task == "embed" else "text"]}}
        if self.context.pool.several:
            card["loaded"] = slot.engine is not None
            card["status"] = {"value": slot.state if slot.engine is None else "loaded"}
        return card

    def router(self) -> APIRouter:
        router = dialect_router(self)
        chat, completions = Chat(self), Completions(self)

        def with_id(request: Request, response: Response) -> Response:
            rid = request.headers.get("x-request-id")
            if rid:
                response.headers["X-Request-Id"] = rid
            return response

        @router.post("/v1/chat/completions", responses=SSE_RESPONSES)
        async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
            self.context.admission.check(sequences(body))  # before any templating or tokenizing
            return with_id(request, await chat(body, request.headers.get("x-request-id")))

        @router.post("/v1/completions", responses=SSE_RESPONSES)
        async def create_completion(body: CompletionRequest, request: Request) -> Response:
            self.context.admission.check(sequences(body) * prompt_count(body.prompt))
            return with_id(request, await completions(body, request.headers.get("x-request-id")))

        @router.get("/v1/models")
        async def list_models() -> JSONResponse:
            if not self.context.pool.several:
                return JSONResponse({"object": "list",
                                     "data": [self._model_card(n) for n in self.context.served_model_names]})
            cards = [self._model_card(n, slot) for slot in self.context.pool.slots for n in slot.served_names]
            return JSONResponse({"object": "list", "data": cards})

        @router.get("/v1/models/{model_id:path}")
        async def get_model(model_id: str) -> JSONResponse:
            slot = self.context.pool.find(model_id) if self.context.pool.several else None
            if slot is not None:  # described as it is, without loading it
                return JSONResponse(self._model_card(slot.name, slot))
            return JSONResponse(self._model_card(self.context.check_model(model_id)))

        @router.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": __version__})

        pooling, tokens = Pooling(self), self.tokens

        @router.post("/v1/embeddings")
        async def create_embedding(body: EmbeddingRequest) -> Response:
            return await pooling.embeddings(body)

        @router.post("/score")
        async def score(body: ScoreRequest) -> Response:
            return await pooling.score(body)

        @router.post("/v1/score")
        async def score_v1(body: ScoreRequest) -> Response:
            return await pooling.score(body)

        @router.post("/rerank")
        async def rerank(body: RerankRequest) -> Response:
            return await pooling.rerank(body, cohere=False)

        @router.post("/v1/rerank")
        async def rerank_v1(body: RerankRequest) -> Response:
            return await pooling.rerank(body, cohere=False)

        @router.post("/v2/rerank")
        async def rerank_v2(body: RerankRequest) -> Response:
            return await pooling.rerank(body, cohere=True)

        @router.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> Response:
            return await tokens.detokenize(body)

        @router.get("/tokenizer_info")
        async def tokenizer_info() -> Response:
            return await tokens.tokenizer_info()

        return router

    @property
    def tokens(self) -> Tokens:
        if not hasattr(self, "_tokens"):
            self._tokens = Tokens(self)
        return self._tokens

    def shared_routes(self) -> list[SharedRoute]:
        async def tokenize(request: Request, body: Any) -> Response:
            return await self.tokens.tokenize(parse_model(TokenizeRequest, body))

        return [SharedRoute("POST", "/tokenize", accepts_tokenize, tokenize,
                            "a vLLM body with `prompt` or `messages`", TokenizeRequest)]

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        """The OpenAI envelope (the default ``error_body``), telling the openai client whether to
        retry and echoing the request id."""
        response = super().error_response(error, request)
        if error.status < 500 and error.status != 429:
            response.headers["x-should-retry"] = "false"
        if request is not None and request.headers.get("x-request-id"):
            response.headers["X-Request-Id"] = request.headers["x-request-id"]
        return response
