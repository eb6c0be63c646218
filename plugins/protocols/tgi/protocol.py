"""The TGI protocol: ``POST /``, ``/generate``, ``/generate_stream`` (in ``generate.py``),
``/tokenize``, ``GET /info``, and TGI's error format.

Wire facts (see docs/tgi.md): ``POST /`` answers a JSON *list* (text-generation indexes
``[0]``), streams are SSE with one event per token and no ``[DONE]``, errors are
``{"error", "error_type"}`` with TGI's lower-case types and statuses (validation 422,
overloaded 429, generation 424), validation errors say "Input validation error: ...".
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve import (
    EngineDeadError,
    InvalidRequestError,
    LLMServeError,
    ModelLoadingError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from llmserve import dialect_router, parse_model
from llmserve import SSE_RESPONSES
from llmserve import Protocol
from llmserve import SharedRoute

from .generate import Generate
from .tokens import TokenFactory
from .wire import TGICompatRequest, TGIGenerateRequest, TGIOptions

VALIDATION_PREFIX = "Input validation error: "


def error_body(error: LLMServeError) -> tuple[int, dict[str, str]]:
    """A core error in TGI's words: ``(status, {"error", "error_type"})``."""
    msg = error.message
    if isinstance(error, (InvalidRequestError, PayloadTooLargeError)) or error.status in (400, 422):
        status = 413 if isinstance(error, PayloadTooLargeError) else 422
        if not msg.startswith(VALIDATION_PREFIX):
            msg = VALIDATION_PREFIX + msg
        return status, {"error": msg, "error_type": "validation"}
    if isinstance(error, OverloadedError) or error.status == 429:
        return 429, {"error": f"Model is overloaded: {msg}" if msg else "Model is overloaded",
                     "error_type": "overloaded"}
    if isinstance(error, NotFoundError):
        return 404, {"error": msg, "error_type": "not_found"}
    if isinstance(error, UnauthorizedError):
        return error.status, {"error": msg, "error_type": "authentication"}
    if isinstance(error, ModelLoadingError):  # not a failed generation: retry once /ready answers 200
        return error.status, {"error": msg, "error_type": "unavailable"}
    status = error.status if isinstance(error, EngineDeadError) or error.status == 408 else 424
    return status, {"error": f"Request failed during generation: {msg}", "error_type": "generation"}


class TGIProtocol(Protocol):
    """Hugging Face text-generation-inference's native API."""

    error_schema = {"title": "TGIError", "type": "object", "required": ["error", "error_type"],
                    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}

    def __init__(self, context: Any, options: TGIOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or TGIOptions()
        self._tokens: TokenFactory | None = None
        self.generate = Generate(self)

    @property
    def tokens(self) -> TokenFactory:
        if self._tokens is None:  # the model loads after the routes are built
            model = self.context.model
            self._tokens = TokenFactory(self.context.engine.tokenizer, list(model.eos_token_ids))
        return self._tokens

    # -- routes --------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        router = dialect_router(self, tags=["TGI"])
        generate = self.generate

        @router.post("/", responses=SSE_RESPONSES,
                     summary="TGI compat route: a JSON list, or an SSE stream when `stream` is true")
        async def compat_generate(body: TGICompatRequest) -> Response:
            if body.stream:
                return await generate.stream(body, default_full_text=self.opts.compat_return_full_text)
            return await generate(body, as_list=True, default_full_text=self.opts.compat_return_full_text)

        @router.post("/generate_stream", responses=SSE_RESPONSES, summary="TGI: SSE stream, one event per token")
        async def generate_stream(body: TGIGenerateRequest) -> Response:
            return await generate.stream(body)

        @router.get("/info", summary="TGI: model and router limits")
        async def info() -> JSONResponse:
            return JSONResponse(self.info())

        return router

    def shared_routes(self) -> list[SharedRoute]:
        def is_tgi(body: Any) -> bool:
            return isinstance(body, dict) and "inputs" in body

        async def generate(request: Request, body: Any) -> Response:
            return await self.generate(parse_model(TGIGenerateRequest, body))

        async def tokenize(request: Request, body: Any) -> Response:
            parsed = parse_model(TGIGenerateRequest, body)
            if isinstance(parsed.inputs, str):  # --max-prompt-chars before tokenizing, in a worker thread
                self.context.engine.limits.check_prompt(parsed.inputs, "inputs")
            return JSONResponse(await self.context.engine.in_worker(self.tokenize, parsed))

        return [SharedRoute("POST", "/generate", is_tgi, generate, "a TGI body with `inputs`", TGIGenerateRequest),
                SharedRoute("POST", "/tokenize", is_tgi, tokenize, "a TGI body with `inputs`", TGIGenerateRequest)]

    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]:
        return error_body(error)

    def tokenize(self, body: TGIGenerateRequest) -> list[dict]:
        """TGI's /tokenize: ``[{id, text, start, stop}]`` with character offsets into ``inputs``."""
        if not isinstance(body.inputs, str):
            raise InvalidRequestError("`inputs` must be a string: multimodal inputs are not supported by this server",
                                      param="inputs")
        if not body.inputs:
            raise InvalidRequestError("`inputs` cannot be empty", param="inputs")
        add_special = body.add_special_tokens is not False
        tokenizer = self.context.engine.tokenizer
        try:
            enc = tokenizer(body.inputs, add_special_tokens=add_special, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        except Exception:  # noqa: BLE001 - slow or custom tokenizers: offsets from incremental decodes
            ids = self.context.engine.encode(body.inputs, add_special_tokens=add_special)
            offsets, pos, prev = [], 0, ""
            for i in range(len(ids)):
                text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
                grown = len(text) - len(prev) if text.startswith(prev) else 0
                offsets.append((pos, pos + grown))
                pos, prev = pos + grown, text
        return [{"id": int(tid), "text": body.inputs[start:stop], "start": start, "stop": stop}
                for tid, (start, stop) in zip(ids, offsets)]

    def info(self) -> dict:
        model, config = self.context.model, self.context.config
        max_total = self.context.engine.max_model_len if self.context.engine else (model.max_model_len if model else 0)
        max_input = min(self.opts.max_input_tokens or max_total - 1, max_total - 1)
        return {
            "model_id": self.context.model_name,
            "model_sha": None,
            "model_dtype": config.llm.dtype,
            "model_device_type": config.llm.device,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": config.scheduler.max_num_seqs,
            "max_best_of": self.opts.max_best_of,
            "max_stop_sequences": self.opts.max_stop_sequences,
            "max_input_tokens": max_input,
            "max_input_length": max_input,
            "max_total_tokens": max_total,
            "max_batch_total_tokens": config.scheduler.max_num_batched_tokens,
            "max_batch_size": config.scheduler.max_num_seqs,
            "max_top_n_tokens": self.opts.max_top_n_tokens,
            "validation_workers": 1,
            "max_client_batch_size": self.opts.max_client_batch_size,
            "router": "text-generation-router",
            "version": __version__,
            "sha": None,
            "docker_label": None,
        }
