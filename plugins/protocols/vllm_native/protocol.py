"""vLLM's native ``POST /generate`` (the ``prompt`` half of the shared route).

Request: ``{"prompt": str, "stream"?: bool, ...sampling fields}`` (vLLM's api_server passes
every other key to SamplingParams; MindIE documents the set below). Reply:
``{"text": [prompt + output, ...]}``, one string per sequence, the prompt and the output
concatenated verbatim. Stream: a plain chunked body (not SSE) of JSON records, each followed by
``\\0``; every record holds the *cumulative* ``prompt + output so far`` of every sequence, which
is what vLLM's ``examples/api_client.py`` reads (it keeps the last record). Errors use the
OpenAI envelope with status 400, as vLLM's servers do; an error after the stream started is
one more record ``{"error": {...}}\\0``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Union

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.server.protocol import Protocol
from llmserve.request import GenerateRequest
from llmserve.sampling import SamplingParams
from llmserve.server.errors import openai_error_response, to_error, validation_to_error
from llmserve.server.shared import SharedRoute

MAX_PROMPT_CHARS = 4 * 1024 * 1024   # MindIE: 0 < characters <= 4 MB
MAX_STOP_CHARS = 32 * 1024           # MindIE: total characters of all stop strings
INT32 = (-(2**31), 2**31 - 1)
NO_MODEL = ("", "None")              # MindIE's documented default for `model` is the string "None"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class VLLMNativeOptions(BaseModel):
    """Options from the ``vllm_native:`` section of the YAML config."""

    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int | None = Field(
        16, ge=1, description="max_tokens when a request gives none (vLLM's SamplingParams default: 16; "
                              "null: up to the context length).")


class VLLMGenerateRequest(BaseModel):
    """Body of vLLM-native ``POST /generate``. Unknown keys are ignored; nulls mean the default."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    prompt: Union[str, list[dict[str, Any]]] = Field(description="The prompt (text only; multimodal lists are rejected).")
    stream: bool | None = Field(False, description="true: `\\0`-separated JSON records instead of one JSON object.")
    n: int | None = Field(None, description="Sequences returned (default 1).")
    best_of: int | None = Field(None, description="Sequences generated; the n most likely are returned.")
    max_tokens: int | None = Field(None, description="Most tokens to generate per sequence (default 16).")
    min_tokens: int | None = Field(None, description="Generate at least this many tokens before EOS/stop.")
    temperature: float | None = Field(None, description=">= 0; 0 is greedy (default 1.0).")
    top_p: float | None = Field(None, description="In (0, 1] (default 1.0).")
    top_k: int | None = Field(None, description="-1 (off) or >= 1.")
    min_p: float | None = Field(None, description="In [0, 1].")
    repetition_penalty: float | None = Field(None, description="In (0, 2] (default 1.0).")
    presence_penalty: float | None = Field(None, description="In [-2, 2] (default 0).")
    frequency_penalty: float | None = Field(None, description="In [-2, 2] (default 0).")
    seed: int | None = Field(None, description="Random seed, 0 .. 2^64-1.")
    stop: Union[str, list[str], None] = Field(None, description="Stop strings (1+ characters each, 32768 in all).")
    stop_token_ids: list[int] | None = Field(None, description="Stop token ids (ids outside int32 are ignored).")
    bad_words: list[str] | None = Field(None, description="Words never generated.")
    include_stop_str_in_output: bool | None = Field(None, description="Keep the matched stop string (default false).")
    skip_special_tokens: bool | None = Field(None, description="Drop special tokens from the text (default true).")
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool | None = Field(None, description="Keep generating after EOS (default false).")
    model: str | None = Field(None, description="LoRA id in MindIE: null, \"None\" or a served model name.")
    use_beam_search: bool | None = Field(None, description="Not supported: only false / null.")


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def sampling_params(body: VLLMGenerateRequest, default_max_tokens: int | None) -> SamplingParams:
    """The spec's ranges, in vLLM's wording, then the kernel's own checks."""
    n = 1 if body.n is None else body.n
    _check(n >= 1, f"n must be at least 1, got {n}.", "n")
    if body.best_of is not None:
        _check(body.best_of >= n, f"best_of must be greater than or equal to n, got n={n} and best_of={body.best_of}.",
               "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.", name)
    if body.repetition_penalty is not None:
        _check(0.0 < body.repetition_penalty <= 2.0,
               f"repetition_penalty must be in (0, 2], got {body.repetition_penalty}.", "repetition_penalty")
    if body.temperature is not None:
        _check(body.temperature >= 0.0, f"temperature must be non-negative, got {body.temperature}.", "temperature")
    if body.top_p is not None:
        _check(0.0 < body.top_p <= 1.0, f"top_p must be in (0, 1], got {body.top_p}.", "top_p")
    if body.top_k is not None:
        _check(body.top_k == -1 or body.top_k >= 1, f"top_k must be -1 (disable), or at least 1, got {body.top_k}.",
               "top_k")
    if body.min_p is not None:
        _check(0.0 <= body.min_p <= 1.0, f"min_p must be in [0, 1], got {body.min_p}.", "min_p")
    if body.max_tokens is not None:
        _check(body.max_tokens >= 1, f"max_tokens must be at least 1, got {body.max_tokens}.", "max_tokens")
    if body.min_tokens is not None:
        _check(body.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.",
               "min_tokens")
    if body.seed is not None:
        _check(0 <= body.seed <= 2**64 - 1, f"seed must be in [0, {2**64 - 1}], got {body.seed}.", "seed")
    if body.use_beam_search:
        raise InvalidRequestError("use_beam_search is not supported by this server (send false or leave it out)",
                                  param="use_beam_search")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _check(all(stop), "stop strings must be at least 1 character long.", "stop")
    total = sum(len(s) for s in stop)
    _check(total <= MAX_STOP_CHARS, f"the stop strings must be at most {MAX_STOP_CHARS} characters in all, got {total}.",
           "stop")
    stop_ids = [t for t in body.stop_token_ids or [] if INT32[0] <= t <= INT32[1]]  # MindIE ignores the others
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    if max_tokens is not None and body.min_tokens is not None:
        _check(body.min_tokens <= max_tokens,
               f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}.",
               "min_tokens")
    return SamplingParams.build(
        n=n, best_of=body.best_of, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stop, stop_token_ids=stop_ids,
        bad_words=body.bad_words, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, max_tokens=max_tokens)


def record(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\0").encode("utf-8")


class VLLMNativeProtocol(Protocol):
    """vLLM's native generate API (as MindIE serves it)."""

    def __init__(self, context: Any, options: VLLMNativeOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or VLLMNativeOptions()

    def router(self) -> APIRouter:
        return APIRouter()  # its only route, POST /generate, is shared with TGI

    def shared_routes(self) -> list[SharedRoute]:
        def is_vllm(body: Any) -> bool:
            return isinstance(body, dict) and "prompt" in body

        return [SharedRoute("POST", "/generate", is_vllm, self.generate, "a vLLM body with `prompt`",
                            VLLMGenerateRequest, stream_media_type="text/plain")]

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        return openai_error_response(error)

    def _request(self, body: VLLMGenerateRequest) -> GenerateRequest:
        if not isinstance(body.prompt, str):
            raise InvalidRequestError("prompt: multimodal (list) prompts are not supported by this server",
                                      param="prompt")
        if not body.prompt:
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        if len(body.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompt must be at most {MAX_PROMPT_CHARS} characters, got {len(body.prompt)}",
                                      param="prompt")
        if body.model not in (None, *NO_MODEL):
            self.context.check_model(body.model)
        sampling = sampling_params(body, self.opts.default_max_tokens)
        request = GenerateRequest(prompt=body.prompt, sampling=sampling, request_id=f"gen-{uuid.uuid4().hex}")
        self.context.engine.prepare(request)  # a bad request fails here, with a status code
        return request

    async def generate(self, request: Request, raw: Any) -> Response:
        try:
            body = VLLMGenerateRequest.model_validate(raw)
        except ValidationError as exc:
            raise validation_to_error(RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)])) from None
        self.context.admission.check(max(body.n or 1, body.best_of or 1, 1))  # before tokenizing
        req = self._request(body)
        if body.stream:
            return StreamingResponse(self._stream(body.prompt, req), media_type="text/plain; charset=utf-8",
                                     headers=STREAM_HEADERS)
        texts = self._texts(req)
        async for event in self.context.engine.generate(req):
            for d in event.outputs:
                if d.index < len(texts):
                    texts[d.index] += d.text
        return JSONResponse({"text": [body.prompt + t for t in texts]})

    @staticmethod
    def _texts(req: GenerateRequest) -> list[str]:
        return [""] * req.sampling.n

    async def _stream(self, prompt: str, req: GenerateRequest) -> AsyncIterator[bytes]:
        texts = self._texts(req)
        try:
            async for event in self.context.engine.generate(req):
                for d in event.outputs:
                    if d.index < len(texts):
                        texts[d.index] += d.text
                yield record({"text": [prompt + t for t in texts]})
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            error = to_error(exc)
            yield record({"error": {"message": error.message, "type": error.type, "param": error.param,
                                    "code": error.status}})
