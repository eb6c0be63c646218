"""The MindIE native dialect: ``POST /infer`` and ``POST /v1/tokenizer`` with MindIE's errors."""

from __future__ import annotations

from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import EngineDeadError, InvalidRequestError, LLMServeError
from llmserve import PreparedRequest
from llmserve import STREAM_HEADERS, MalformedBodyError, dialect_router, in_band_errors, parse_body, sse
from llmserve import SSE_RESPONSES, openapi_body
from llmserve import Protocol
from llmserve import ChatTurn, prepare_chat

from .media import multimodal_turn
from .params import MAX_INPUT_CHARS, POLICY, build_sampling, deadline, new_request, priority
from .events import TokenClock, first_sequence
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
        assert isinstance(body.inputs, str)
        if not body.inputs:
            raise InvalidRequestError("inputs: must not be empty", param="inputs")
        if len(body.inputs) > MAX_INPUT_CHARS:
            raise InvalidRequestError(f"inputs: longer than {MAX_INPUT_CHARS} characters", param="inputs")
        return body.inputs

    async def infer(self, request: Request) -> Response:
        body = parse_body(InferBody, await request.body())
        p = body.parameters or InferParameters()
        engine = self._engine()
        if isinstance(body.inputs, list):  # text and images, through the model's chat template
            content, images = multimodal_turn(body.inputs, self.context.config.media.max_image_bytes)
            self.context.admission.check(1)  # before fetching and tokenizing
            sampling, seed = build_sampling(p)
            turn = ChatTurn(sampling=sampling, messages=[{"role": "user", "content": content}], images=images,
                            policy=POLICY, priority=priority(p.priority), deadline=deadline(p.timeout),
                            no_template="inputs: a multimodal list needs the model's chat template, which it lacks")
            req = (await prepare_chat(self.context, turn)).request
        else:
            prompt = self._prompt(body)
            self.context.admission.check(1)  # before tokenizing
            req, seed = await engine.in_worker(new_request, engine, p, text=prompt)  # tokenizes
        if body.stream:
            return self.context.sse_response(in_band_errors(self, self._stream(req, p, seed), sse),
                                             headers=STREAM_HEADERS)
        text, generated, reason = "", 0, None
        async for event in engine.generate(req):
            ids, delta, ended = first_sequence(event)
            text += delta
            generated += len(ids)
            reason = ended or reason
        out: dict[str, Any] = {"generated_text": text}
        if p.details:
            out["details"] = {"finish_reason": reason or "length", "generated_tokens": generated, "seed": seed}
        return JSONResponse(out)

    async def _stream(self, req: PreparedRequest, p: InferParameters, seed: int | None) -> AsyncGenerator[str, None]:
        clock = TokenClock()
        text_all, generated = "", 0
        engine = self._engine()
        async for event in engine.generate(req):
            ids, text, reason = first_sequence(event)
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

    async def tokenizer(self, request: Request) -> Response:
        body = parse_body(TokenizerBody, await request.body())
        engine = self._engine()
        ids = await engine.aencode(body.inputs, param="inputs")
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
        r = dialect_router(self)

        @r.post("/infer", openapi_extra=openapi_body(InferBody), responses=SSE_RESPONSES)
        async def mindie_infer(request: Request) -> Response:
            return await self.infer(request)

        @r.post("/v1/tokenizer", openapi_extra=openapi_body(TokenizerBody))
        async def mindie_tokenizer(request: Request) -> Response:
            return await self.tokenizer(request)

        return r

    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]:
        """``{"error": msg, "error_type": "Input Validation Error" | ...}`` with MindIE's statuses."""
        status, kind = mindie_status(error)
        return status, {"error": error.message, "error_type": kind}
