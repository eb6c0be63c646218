"""The MindIE native dialect: ``POST /infer`` and ``POST /v1/tokenizer`` with MindIE's errors."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve.errors import EngineDeadError, InvalidRequestError, LLMServeError
from llmserve.server.protocol import Protocol
from llmserve.request import GenerateRequest
from llmserve.server.errors import error_headers, to_error
from llmserve.server.openapi import SSE_RESPONSES

from .params import (
    MAX_INPUT_CHARS,
    SSE_HEADERS,
    MalformedBodyError,
    TokenClock,
    build_sampling,
    deadline,
    finish_reason,
    guarded,
    openapi_body,
    parse_body,
    priority,
    sse,
)
from .wire import InferBody, InferParameters, TokenizerBody


def mindie_status(error: LLMServeError) -> tuple[int, str]:
    """(HTTP status, error_type) with MindIE's status texts."""
    status = error.status
    if isinstance(error, MalformedBodyError):
        return 400, "Bad Request"
    if status == 404:
        return 404, "NotFoundError"
    if status == 503:
        return 503, "Service Unavailable"
    if status in (400, 422):
        return 422, "Input Validation Error"
    if status == 408:  # the request's timeout expired before it produced anything
        return 424, "Generation Error"
    if 400 <= status < 500:
        return status, "Bad Request"
    return 500, "Incomplete Generation"


class MindIEProtocol(Protocol):
    error_schema = {"title": "MindIEError", "type": "object", "required": ["error", "error_type"],
                    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}

    def _engine(self) -> Any:
        engine = self.context.engine
        if engine is None or engine.is_dead:
            raise EngineDeadError("the model is not ready")
        return engine

    @staticmethod
    def _prompt(body: InferBody) -> str:
        if not isinstance(body.inputs, str):
            raise InvalidRequestError("inputs: multimodal (list) inputs are not supported by this server; "
                                      "send the prompt as a string", param="inputs")
        if not body.inputs:
            raise InvalidRequestError("inputs: must not be empty", param="inputs")
        if len(body.inputs) > MAX_INPUT_CHARS:
            raise InvalidRequestError(f"inputs: longer than {MAX_INPUT_CHARS} characters", param="inputs")
        return body.inputs

    async def infer(self, request: Request) -> Response:
        body = parse_body(InferBody, await request.body())
        prompt = self._prompt(body)
        p = body.parameters or InferParameters()
        engine = self._engine()
        self.context.admission.check(1)  # before tokenizing
        ids = engine.encode(prompt)
        sampling, seed = build_sampling(p, len(ids), engine.max_model_len)
        req = GenerateRequest(prompt=prompt, prompt_token_ids=ids, sampling=sampling,
                              priority=priority(p.priority), deadline=deadline(p.timeout))
        engine.prepare(req, param="inputs")
        if body.stream:
            return self.context.sse_response(self._stream(req, p, seed), headers=SSE_HEADERS)
        text, generated, reason = "", 0, None
        async for event in engine.generate(req):
            for d in event.outputs:
                if d.index == 0:
                    text += d.text
                    generated += len(d.token_ids)
                    reason = finish_reason(d) or reason
        out: dict[str, Any] = {"generated_text": text}
        if p.details:
            out["details"] = {"finish_reason": reason or "length", "generated_tokens": generated, "seed": seed}
        return JSONResponse(out)

    async def _stream(self, req: GenerateRequest, p: InferParameters, seed: int | None) -> AsyncIterator[str]:
        clock = TokenClock()
        text_all, generated = "", 0
        try:
            engine = self._engine()
            async for event in engine.generate(req):
                ids: list[int] = []
                text, reason = "", None
                for d in event.outputs:
                    if d.index == 0:
                        ids += d.token_ids
                        text += d.text
                        reason = finish_reason(d) or reason
                generated += len(ids)
                text_all += text
                prefill_ms, decode_ms = clock.add(event, ids, engine)
                out: dict[str, Any] = {"prefill_time": prefill_ms, "decode_time": decode_ms}
                if event.finished:
                    # The last event carries the whole text; its token's text is null (MindIE's shape).
                    out["generated_text"] = text_all
                    if p.details:
                        out["details"] = {"finish_reason": reason or "length", "generated_tokens": generated,
                                          "seed": seed}
                    out["token"] = {"id": ids, "text": None}
                else:
                    out["token"] = {"id": ids, "text": text}
                yield sse(out)
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            error = to_error(exc)
            yield sse({"error": error.message, "error_type": mindie_status(error)[1]})

    async def tokenizer(self, request: Request) -> Response:
        body = parse_body(TokenizerBody, await request.body())
        engine = self._engine()
        ids = engine.encode(body.inputs)
        limit = engine.max_model_len - 1
        if len(ids) > limit:
            raise InvalidRequestError(f"inputs: {len(ids)} tokens is more than the maximum input length of {limit} "
                                      f"tokens", param="inputs")
        tok = engine.tokenizer
        if body.do_decode is False and hasattr(tok, "convert_ids_to_tokens"):
            tokens = [str(t) for t in tok.convert_ids_to_tokens(ids)]
        else:
            tokens = [engine.decode([i], skip_special_tokens=False) for i in ids]
        return JSONResponse({"token_number": len(ids), "tokens": tokens})

    def router(self) -> APIRouter:
        r = APIRouter()

        @r.post("/infer", openapi_extra=openapi_body(InferBody), responses=SSE_RESPONSES)
        @self._guard
        async def mindie_infer(request: Request) -> Response:
            return await self.infer(request)

        @r.post("/v1/tokenizer", openapi_extra=openapi_body(TokenizerBody))
        @self._guard
        async def mindie_tokenizer(request: Request) -> Response:
            return await self.tokenizer(request)

        return r

    def _guard(self, endpoint: Any) -> Any:
        return guarded(self, endpoint)

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        """``{"error": msg, "error_type": "Input Validation Error" | ...}`` with MindIE's statuses."""
        status, kind = mindie_status(error)
        return JSONResponse({"error": error.message, "error_type": kind}, status_code=status,
                            headers=error_headers(error))
