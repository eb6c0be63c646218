"""The generate extension in MindIE's shape: ``/v2/models/{m}/generate`` (one JSON reply) and
``/generate_stream`` (SSE, one event per engine step), with MindIE's ``details`` and timings."""

from __future__ import annotations

import uuid
from typing import Any, AsyncGenerator

from fastapi import Request
from starlette.responses import JSONResponse, Response

from llmserve import InvalidRequestError
from llmserve import RequestOutput
from llmserve import PreparedRequest
from llmserve import STREAM_HEADERS, UnsupportedError, in_band_errors, load_json, parse_model, sse

from ..mindie.events import TokenClock, first_sequence
from ..mindie.params import MAX_INPUT_CHARS
from .host import TritonHost
from .wire import GENERATE_PARAMETER_NAMES, GenerateBody, GenerateParameters, check_id


def generate_body(data: Any) -> GenerateBody:
    """The body, with parameters given at the top level moved into ``parameters``."""
    if isinstance(data, dict):
        params = data.get("parameters")
        params = dict(params) if isinstance(params, dict) else params
        top = {k: data[k] for k in GENERATE_PARAMETER_NAMES if k in data}
        if "max_tokens" in data and "max_new_tokens" not in top:
            top["max_new_tokens"] = data["max_tokens"]
        if top and (params is None or isinstance(params, dict)):
            data = {**data, "parameters": {**top, **(params or {})}}
    body = parse_model(GenerateBody, data)
    if not isinstance(body.text_input, str):
        raise UnsupportedError("text_input: multimodal (list) inputs are not supported by this server; "
                               "send the prompt as a string")
    if not body.text_input:
        raise InvalidRequestError("text_input: must not be empty", param="text_input")
    if len(body.text_input) > MAX_INPUT_CHARS:
        raise InvalidRequestError(f"text_input: longer than {MAX_INPUT_CHARS} characters", param="text_input")
    check_id(body.id)
    return body


def details(p: GenerateParameters, clock: TokenClock, generated: int, reason: str | None,
            event: RequestOutput | None, stream: bool) -> dict[str, Any]:
    """MindIE's ``details``: per event when streaming, for the whole request otherwise."""
    out: dict[str, Any] = {}
    if reason is not None:
        out["finish_reason"] = reason
    out.update({"generated_tokens": generated, "first_token_cost": None, "decode_cost": None})
    if p.perf_stat:
        out["perf_stat"] = [list(x) for x in clock.perf]
    out["batch_size"] = clock.batch if stream else clock.max_batch
    out["queue_wait_time"] = TokenClock.queue_wait_us(event) if event is not None else 0
    if not stream:
        out["prefill_time"] = clock.prefill_ms
        out["decode_time"] = clock.decode_ms(event) if event is not None else 0.0
    return out


class Generate:
    """The two generate routes of one ``TritonProtocol``."""

    def __init__(self, protocol: TritonHost) -> None:
        self.p = protocol

    async def __call__(self, request: Request, model_name: str, model_version: str | None, stream: bool) -> Response:
        p = self.p
        raw = await p.read_body(request)  # read the body first, even when the reply is an error
        name = p.check_model(model_name, model_version)
        body = generate_body(load_json(raw))
        params = body.parameters or GenerateParameters()
        p.context.admission.check(1)  # before tokenizing
        req = await p.new_request(params, text=body.text_input)
        head = {"id": body.id or uuid.uuid4().hex, "model_name": name, "model_version": None}
        if stream:
            return p.context.sse_response(in_band_errors(p, self._stream(head, req, params), sse),
                                          headers=STREAM_HEADERS)
        res = await p.collect(req)
        out: dict[str, Any] = {**head, "text_output": res.text}
        if params.details or params.perf_stat:
            out["details"] = details(params, res.clock, len(res.token_ids), res.finish_reason or "length", res.last,
                                     stream=False)
        return JSONResponse(out)

    async def _stream(self, head: dict[str, Any], req: PreparedRequest,
                      params: GenerateParameters) -> AsyncGenerator[str, None]:
        clock = TokenClock()
        generated = 0
        engine = self.p.engine()
        async for event in engine.generate(req):
            ids, text, reason = first_sequence(event)
            if event.finished and reason is None:
                reason = "length"
            generated += len(ids)
            prefill_ms, decode_ms = clock.add(event, ids, engine)
            out: dict[str, Any] = {**head, "text_output": text}
            if params.details or params.perf_stat:
                out["details"] = details(params, clock, generated, reason, event, stream=True)
            out["prefill_time"] = prefill_ms
            out["decode_time"] = decode_ms
            yield sse(out)
