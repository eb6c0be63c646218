"""The TGI protocol: ``POST /``, ``/generate``, ``/generate_stream``, ``/tokenize``, ``GET /info``.

Wire facts (see docs/tgi.md): ``POST /`` answers a JSON *list* (text-generation indexes
``[0]``), streams are SSE with one event per token and no ``[DONE]``, errors are
``{"error", "error_type"}`` with TGI's lower-case types and statuses (validation 422,
overloaded 429, generation 424), validation errors say "Input validation error: ...".
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from llmserve.server.protocol import Protocol
from llmserve.server.errors import error_headers, to_error, validation_to_error
from llmserve.server.openapi import SSE_RESPONSES
from llmserve.server.shared import SharedRoute

from .params import Plan, validate
from .tokens import Sequence, TokenFactory
from .wire import TGICompatRequest, TGIGenerateRequest, TGIOptions

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
VALIDATION_PREFIX = "Input validation error: "


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def error_body(error: LLMServeError) -> tuple[int, dict[str, str]]:
    """A kernel error in TGI's words: ``(status, {"error", "error_type"})``."""
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
    status = error.status if isinstance(error, EngineDeadError) or error.status == 408 else 424
    return status, {"error": f"Request failed during generation: {msg}", "error_type": "generation"}


def parse(model: Any, body: Any) -> Any:
    """Validate a shared route's parsed JSON body like FastAPI would (errors -> 422)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_to_error(RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])) from None


class TGIProtocol(Protocol):
    """Hugging Face text-generation-inference's native API."""

    error_schema = {"title": "TGIError", "type": "object", "required": ["error", "error_type"],
                    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}

    def __init__(self, context: Any, options: TGIOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or TGIOptions()
        self._tokens: TokenFactory | None = None

    @property
    def tokens(self) -> TokenFactory:
        if self._tokens is None:  # the model loads after the routes are built
            model = self.context.model
            self._tokens = TokenFactory(self.context.engine.tokenizer, list(model.eos_token_ids))
        return self._tokens

    # -- routes --------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        router = APIRouter(tags=["TGI"])

        @router.post("/", responses=SSE_RESPONSES, summary="TGI compat route: a JSON list, or an SSE stream when `stream` is true")
        async def compat_generate(body: TGICompatRequest) -> Response:
            if body.stream:
                return await self.generate_stream(body, default_full_text=self.opts.compat_return_full_text)
            return await self.generate(body, as_list=True, default_full_text=self.opts.compat_return_full_text)

        @router.post("/generate_stream", responses=SSE_RESPONSES, summary="TGI: SSE stream, one event per token")
        async def generate_stream(body: TGIGenerateRequest) -> Response:
            return await self.generate_stream(body)

        @router.get("/info", summary="TGI: model and router limits")
        async def info() -> JSONResponse:
            return JSONResponse(self.info())

        return router

    def shared_routes(self) -> list[SharedRoute]:
        def is_tgi(body: Any) -> bool:
            return isinstance(body, dict) and "inputs" in body

        async def generate(request: Request, body: Any) -> Response:
            return await self.generate(parse(TGIGenerateRequest, body))

        async def tokenize(request: Request, body: Any) -> Response:
            return JSONResponse(self.tokenize(parse(TGIGenerateRequest, body)))

        return [SharedRoute("POST", "/generate", is_tgi, generate, "a TGI body with `inputs`", TGIGenerateRequest),
                SharedRoute("POST", "/tokenize", is_tgi, tokenize, "a TGI body with `inputs`", TGIGenerateRequest)]

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        status, body = error_body(error)
        return JSONResponse(body, status_code=status, headers=error_headers(error))

    # -- work ----------------------------------------------------------------------------------
    async def _plan(self, body: TGIGenerateRequest, *, stream: bool, default_full_text: bool) -> Plan:
        engine = self.context.engine
        plan = validate(body, self.opts, engine, stream=stream, default_full_text=default_full_text)
        if plan.guided is not None:
            try:
                plan.mask_factory = await asyncio.to_thread(self.context.guided.compile, plan.guided)
            except InvalidRequestError as exc:
                msg = exc.message.removeprefix("grammar: ")
                if "needs a guided-decoding plugin" in msg:
                    raise InvalidRequestError(f"grammar is not supported: {msg}", param="grammar") from None
                raise InvalidRequestError(f"grammar is not valid: {msg}", param="grammar") from None
        return plan

    def _prepared(self, plan: Plan) -> list:
        reqs = plan.requests()
        for req in reqs:
            self.context.engine.prepare(req)  # a bad request fails here, with a status code
        return reqs

    def _full(self, plan: Plan, text: str) -> str:
        return plan.inputs + text if plan.return_full_text else text

    def _admit(self, body: TGIGenerateRequest) -> None:
        """Admission first, before validation tokenizes (TGI clients expect 429 when full)."""
        best_of = body.parameters.best_of if body.parameters is not None else None
        self.context.admission.check(best_of if isinstance(best_of, int) and best_of > 1 else 1)

    async def generate(self, body: TGIGenerateRequest, as_list: bool = False,
                       default_full_text: bool = False) -> Response:
        start = time.time()
        self._admit(body)
        plan = await self._plan(body, stream=False, default_full_text=default_full_text)
        reqs = self._prepared(plan)
        seqs = [Sequence(self.tokens, plan.prompt_ids, plan.top_n_tokens) for _ in reqs]
        prompt_lps: dict[int, Any] = {}
        first_token: float | None = None
        async for i, event in self.context.engine.generate_many(reqs):
            if event.prompt_logprobs is not None:
                prompt_lps[i] = event.prompt_logprobs
            for delta in event.outputs:
                seqs[i].feed(delta)
            if first_token is None and event.timings.first_token is not None:
                first_token = event.timings.first_token
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].mean_logprob, reverse=True) \
            if len(seqs) > 1 else [0]
        best = order[0]

        def details_of(i: int, *, best_of_entry: bool = False) -> dict:
            seq = seqs[i]
            out: dict[str, Any] = {}
            if best_of_entry:
                out["generated_text"] = self._full(plan, seq.text)
            out.update({"finish_reason": seq.finish_reason or "length", "generated_tokens": len(seq.tokens),
                        "seed": plan.seeds[i],
                        "prefill": self.tokens.prefill(plan.prompt_ids, prompt_lps.get(i))
                        if plan.decoder_input_details else [],
                        "tokens": seq.tokens})
            if plan.top_n_tokens:
                out["top_tokens"] = seq.top_tokens
            return out

        response: dict[str, Any] = {"generated_text": self._full(plan, seqs[best].text)}
        if plan.details:
            details = details_of(best)
            if plan.best_of > 1:
                details["best_of_sequences"] = [details_of(i, best_of_entry=True) for i in order[1:]]
            response["details"] = details
        total = time.time() - start
        generated = len(seqs[best].tokens)
        headers = {"x-compute-type": "llmserve", "x-compute-time": f"{total:.6f}",
                   "x-compute-characters": str(len(plan.inputs)), "x-total-time": str(int(total * 1000)),
                   "x-prompt-tokens": str(plan.input_length), "x-generated-tokens": str(generated),
                   "x-time-per-token": str(int(total * 1000 / max(generated, 1)))}
        return JSONResponse([response] if as_list else response, headers=headers)

    async def generate_stream(self, body: TGIGenerateRequest, default_full_text: bool = False) -> Response:
        self._admit(body)
        plan = await self._plan(body, stream=True, default_full_text=default_full_text)
        reqs = self._prepared(plan)
        headers = {**SSE_HEADERS, "x-compute-type": "llmserve", "x-compute-characters": str(len(plan.inputs))}
        return self.context.sse_response(self._stream(plan, reqs[0]), headers=headers)

    async def _stream(self, plan: Plan, req: Any) -> AsyncIterator[str]:
        seq = Sequence(self.tokens, plan.prompt_ids, plan.top_n_tokens)
        index = 0
        ended = False
        try:
            async for event in self.context.engine.generate(req):
                for delta in event.outputs:
                    new = seq.feed(delta)
                    finished = delta.finish_reason is not None
                    if finished and not new:  # the request ended without a token (e.g. a deadline)
                        last_id = seq.tokens[-1]["id"] if seq.tokens else 0
                        new = [({"id": last_id, "text": "", "logprob": None, "special": True}, [])]
                    for k, (token, top) in enumerate(new):
                        index += 1
                        last = finished and k == len(new) - 1
                        out: dict[str, Any] = {"index": index, "token": token}
                        if top:
                            out["top_tokens"] = top
                        out["generated_text"] = self._full(plan, seq.text) if last else None
                        out["details"] = {"finish_reason": seq.finish_reason, "generated_tokens": len(seq.tokens),
                                          "seed": plan.seeds[0], "input_length": plan.input_length} \
                            if last and plan.details else None
                        yield sse(out)
                    ended = ended or finished
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            yield sse(error_body(to_error(exc))[1])
            return
        if not ended:
            yield sse({"error": "Incomplete generation stream", "error_type": "incomplete_generation"})

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
            "model_dtype": config.dtype,
            "model_device_type": config.device,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": config.max_num_seqs,
            "max_best_of": self.opts.max_best_of,
            "max_stop_sequences": self.opts.max_stop_sequences,
            "max_input_tokens": max_input,
            "max_input_length": max_input,
            "max_total_tokens": max_total,
            "max_batch_total_tokens": config.max_num_batched_tokens,
            "max_batch_size": config.max_num_seqs,
            "max_top_n_tokens": self.opts.max_top_n_tokens,
            "validation_workers": 1,
            "max_client_batch_size": self.opts.max_client_batch_size,
            "router": "text-generation-router",
            "version": __version__,
            "sha": None,
            "docker_label": None,
        }
