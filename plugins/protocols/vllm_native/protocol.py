"""vLLM's native ``POST /generate`` (the ``prompt`` half of the shared route).

Request: ``{"prompt": str, "stream"?: bool, ...sampling fields}`` (vLLM's api_server passes
every other key to SamplingParams; MindIE documents the set below), and for a vision model
``multi_modal_data: {"image": ...}`` (vLLM's own name) with one placeholder per image in the prompt. Reply:
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
from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmserve import InvalidRequestError, image_from_string, request_images
from llmserve import GenerateRequest, PreparedRequest
from llmserve import STREAM_HEADERS, dialect_router, in_band_errors, parse_model
from llmserve import Protocol
from llmserve import SharedRoute

from .params import guided_spec, sampling_params
from .wire import VLLMGenerateRequest, VLLMNativeOptions

MAX_PROMPT_CHARS = 4 * 1024 * 1024   # MindIE: 0 < characters <= 4 MB
NO_MODEL = ("", "None")              # MindIE's documented default for `model` is the string "None"


def record(obj: Any) -> bytes:
    """One record of a stream: JSON as vLLM's server writes it (default separators), then ``\\0``."""
    return (json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\0").encode("utf-8")


class VLLMNativeProtocol(Protocol):
    """vLLM's native generate API (as MindIE serves it)."""

    def __init__(self, context: Any, options: VLLMNativeOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or VLLMNativeOptions()

    def router(self) -> APIRouter:
        return dialect_router(self)  # its only route, POST /generate, is shared with TGI

    def shared_routes(self) -> list[SharedRoute]:
        def is_vllm(body: Any) -> bool:
            return isinstance(body, dict) and "prompt" in body

        return [SharedRoute("POST", "/generate", is_vllm, self.generate, "a vLLM body with `prompt`",
                            VLLMGenerateRequest, stream_media_type="text/plain")]

    def _request(self, body: VLLMGenerateRequest) -> GenerateRequest:
        if not isinstance(body.prompt, str):
            raise InvalidRequestError("prompt: multimodal (list) prompts are not supported by this server; send the "
                                      "prompt as text with the model's image placeholders, and the images in "
                                      "multi_modal_data", param="prompt")
        if not body.prompt:
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        if len(body.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompt must be at most {MAX_PROMPT_CHARS} characters, got {len(body.prompt)}",
                                      param="prompt")
        if body.model not in (None, *NO_MODEL):
            self.context.check_model(body.model)
        sampling = sampling_params(body, self.opts.default_max_tokens)
        return GenerateRequest(prompt=body.prompt, sampling=sampling, request_id=f"gen-{uuid.uuid4().hex}")

    async def generate(self, request: Request, raw: Any) -> Response:
        body = parse_model(VLLMGenerateRequest, raw)
        self.context.admission.check(max(body.n or 1, body.best_of or 1, 1))  # before tokenizing
        spec = guided_spec(body)
        wanted = self._request(body)
        if body.multi_modal_data is not None:
            await self._images(body.multi_modal_data, wanted)
        if spec is not None:
            wanted.mask_factory = await self.context.guided.compile_async(spec)
        req = await self.context.engine.aprepare(wanted)  # a bad request fails here, with a status code
        if body.stream:
            return StreamingResponse(in_band_errors(self, self._stream(body.prompt, req), record),
                                     media_type="text/plain; charset=utf-8", headers=STREAM_HEADERS)
        texts = self._texts(req)
        async for event in self.context.engine.generate(req):
            for d in event.outputs:
                if d.index < len(texts):
                    texts[d.index] += d.text
        return JSONResponse({"text": [body.prompt + t for t in texts]})

    async def _images(self, data: dict[str, Any], wanted: GenerateRequest) -> None:
        """``multi_modal_data``'s images into ``wanted``: fetched and decoded under the server's
        rules, then each placeholder of the tokenized prompt expanded for its image."""
        param = "multi_modal_data.image"
        unknown = sorted(k for k in data if k != "image")
        if unknown:
            raise InvalidRequestError(f"multi_modal_data: {unknown[0]} inputs are not supported by this server "
                                      "(image is)", param=f"multi_modal_data.{unknown[0]}")
        engine = self.context.engine
        items = data.get("image")
        items = items if isinstance(items, list) else [items]
        cap = self.context.config.media.max_image_bytes
        parts = [image_from_string(v, f"{param}.{i}", cap) for i, v in enumerate(items)]
        images = await request_images(self.context, parts, param)

        def expand() -> tuple[list[int], tuple[Any, ...]]:  # in a tokenizer thread
            return engine.info.media.expand(engine.encode(str(wanted.prompt)), images, param)

        wanted.prompt_token_ids, wanted.media = await engine.in_worker(expand)
        wanted.prompt = None

    @staticmethod
    def _texts(req: PreparedRequest) -> list[str]:
        return [""] * req.sampling.n

    async def _stream(self, prompt: str, req: PreparedRequest) -> AsyncGenerator[bytes, None]:
        texts = self._texts(req)
        async for event in self.context.engine.generate(req):
            for d in event.outputs:
                if d.index < len(texts):
                    texts[d.index] += d.text
            yield record({"text": [prompt + t for t in texts]})
