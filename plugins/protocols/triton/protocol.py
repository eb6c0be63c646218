"""The Triton / KServe v2 dialect: health, model metadata and config, ``infer`` (JSON and
binary tensors, token ids or text) and the generate extension in MindIE's shape."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve.errors import EngineDeadError, InvalidRequestError, LLMServeError, NotFoundError
from llmserve.outputs import RequestOutput
from llmserve.server.protocol import Protocol
from llmserve.request import GenerateRequest
from llmserve.server.errors import error_headers, to_error
from llmserve.server.openapi import SSE_RESPONSES

from ..mindie.params import (
    MAX_INPUT_CHARS,
    SSE_HEADERS,
    TokenClock,
    UnsupportedError,
    build_sampling,
    deadline,
    dumps,
    finish_reason,
    guarded,
    load_json,
    openapi_body,
    parse_model,
    priority,
    sse,
)
from .stats import model_stats as stats_entry
from .tensors import decompress, encode_binary, read_inputs, split_body
from .wire import (
    GENERATE_PARAMETER_NAMES,
    GenerateBody,
    GenerateParameters,
    InferBody,
    RepositoryIndexBody,
    SamplingParameters,
)

VERSION = "1"
PLATFORM = "llmserve"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
TOKEN_INPUT, TOKEN_OUTPUT = "input0", "output0"
TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"


def check_id(value: str | None) -> str | None:
    if value is not None and not _ID.match(value):
        raise InvalidRequestError("id: must be 1-256 characters of letters, digits, '_' and '-'", param="id")
    return value


@dataclass
class Result:
    """One request's whole output."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    clock: TokenClock = field(default_factory=TokenClock)
    last: RequestOutput | None = None


class TritonProtocol(Protocol):
    error_schema = {"title": "KServeError", "type": "object", "required": ["error"],
                    "properties": {"error": {"type": "string"}}}

    # -- model lookup -------------------------------------------------------------------------
    def _model(self, name: str, version: str | None = None) -> str:
        ctx = self.context
        if name not in ctx.served_model_names and not (ctx.model is not None and name == ctx.model.path):
            raise NotFoundError(f"Request for unknown model: '{name}' is not found", param="model")
        if version not in (None, "", VERSION):
            raise NotFoundError(f"Request for unknown model: '{name}' version {version} is not found", param="model")
        return name

    def _ready(self) -> bool:
        ctx = self.context
        engine = ctx.engine
        return bool(ctx.ready and ctx.model is not None and engine is not None and not engine.is_dead)

    def _engine(self) -> Any:
        engine = self.context.engine
        if engine is None or engine.is_dead:
            raise EngineDeadError("the model is not ready")
        return engine

    def _metadata(self, name: str) -> dict[str, Any]:
        return {"name": name, "versions": [VERSION], "platform": PLATFORM,
                "inputs": [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]},
                           {"name": TOKEN_INPUT, "datatype": "UINT32", "shape": [-1]}],
                "outputs": [{"name": TEXT_OUTPUT, "datatype": "BYTES", "shape": [-1]},
                            {"name": TOKEN_OUTPUT, "datatype": "UINT32", "shape": [-1]}]}

    def _config(self, name: str) -> dict[str, Any]:
        info = self.context.model
        return {"name": name, "platform": PLATFORM, "backend": PLATFORM, "max_batch_size": 0,
                "input": [{"name": TEXT_INPUT, "data_type": "TYPE_STRING", "dims": [-1]},
                          {"name": TOKEN_INPUT, "data_type": "TYPE_UINT32", "dims": [-1]}],
                "output": [{"name": TEXT_OUTPUT, "data_type": "TYPE_STRING", "dims": [-1]},
                           {"name": TOKEN_OUTPUT, "data_type": "TYPE_UINT32", "dims": [-1]}],
                "model_transaction_policy": {"decoupled": False},
                # MindIE's /config fields
                "model_name": name, "input_datatype": "UINT32", "output_datatype": "UINT32",
                "max_seq_len": info.max_model_len if info else None}

    # -- requests -----------------------------------------------------------------------------
    async def _raw(self, request: Request) -> bytes:
        return decompress(await request.body(), request.headers.get("content-encoding"),
                          self.context.config.max_request_body_bytes)

    def _request(self, params: Any, text: str | None = None, ids: list[int] | None = None,
                 param: str = TEXT_INPUT) -> GenerateRequest:
        engine = self._engine()
        if ids is None:
            ids = engine.encode(text or "")
        sampling, _ = build_sampling(params, len(ids), engine.max_model_len)
        req = GenerateRequest(prompt=text, prompt_token_ids=list(ids), sampling=sampling,
                              priority=priority(params.priority), deadline=deadline(params.timeout))
        engine.prepare(req, param=param)
        return req

    async def _collect(self, req: GenerateRequest) -> Result:
        engine = self._engine()
        res = Result()
        async for event in engine.generate(req):
            ids: list[int] = []
            for d in event.outputs:
                if d.index:
                    continue
                ids += d.token_ids
                res.text += d.text
                res.finish_reason = finish_reason(d) or res.finish_reason
            res.token_ids += ids
            res.clock.add(event, ids, engine)
            res.last = event
        return res

    # -- generate extension -------------------------------------------------------------------
    @staticmethod
    def _generate_body(data: Any) -> GenerateBody:
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

    def _details(self, p: GenerateParameters, clock: TokenClock, generated: int, reason: str | None,
                 event: RequestOutput | None, stream: bool) -> dict[str, Any]:
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

    async def generate(self, request: Request, model_name: str, model_version: str | None, stream: bool) -> Response:
        raw = await self._raw(request)  # read the body first, even when the reply is an error
        name = self._model(model_name, model_version)
        body = self._generate_body(load_json(raw))
        p = body.parameters or GenerateParameters()
        self.context.admission.check(1)  # before tokenizing
        req = self._request(p, text=body.text_input)
        head = {"id": body.id or uuid.uuid4().hex, "model_name": name, "model_version": None}
        if stream:
            return self.context.sse_response(self._stream(head, req, p), headers=SSE_HEADERS)
        res = await self._collect(req)
        out: dict[str, Any] = {**head, "text_output": res.text}
        if p.details or p.perf_stat:
            out["details"] = self._details(p, res.clock, len(res.token_ids), res.finish_reason or "length", res.last,
                                           stream=False)
        return JSONResponse(out)

    async def _stream(self, head: dict[str, Any], req: GenerateRequest, p: GenerateParameters) -> AsyncIterator[str]:
        clock = TokenClock()
        generated = 0
        try:
            engine = self._engine()
            async for event in engine.generate(req):
                ids: list[int] = []
                text, reason = "", None
                for d in event.outputs:
                    if d.index:
                        continue
                    ids += d.token_ids
                    text += d.text
                    reason = finish_reason(d) or reason
                if event.finished and reason is None:
                    reason = "length"
                generated += len(ids)
                prefill_ms, decode_ms = clock.add(event, ids, engine)
                out: dict[str, Any] = {**head, "text_output": text}
                if p.details or p.perf_stat:
                    out["details"] = self._details(p, clock, generated, reason, event, stream=True)
                out["prefill_time"] = prefill_ms
                out["decode_time"] = decode_ms
                yield sse(out)
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            yield sse({"error": to_error(exc).message})

    # -- infer --------------------------------------------------------------------------------
    async def infer(self, request: Request, model_name: str, model_version: str | None) -> Response:
        raw = await self._raw(request)  # read the body first, even when the reply is an error
        name = self._model(model_name, model_version)
        head, binary = split_body(raw, request.headers.get("inference-header-content-length"))
        body = parse_model(InferBody, head)
        check_id(body.id)
        params = body.parameters or SamplingParameters()
        names = [t.name for t in body.inputs]
        for n in names:
            if n not in (TOKEN_INPUT, TEXT_INPUT):
                raise InvalidRequestError(f"unexpected inference input '{n}' for model '{name}' (expected "
                                          f"'{TOKEN_INPUT}' UINT32 token ids or '{TEXT_INPUT}' BYTES text)", param="inputs")
        if len(set(names)) != len(names):
            raise InvalidRequestError("each input may appear only once", param="inputs")
        if len(names) != 1:
            raise InvalidRequestError(f"give exactly one input: '{TOKEN_INPUT}' (UINT32 token ids) or '{TEXT_INPUT}' "
                                      f"(BYTES text)", param="inputs")
        tensor = body.inputs[0]
        token_mode = tensor.name == TOKEN_INPUT
        expected = ("UINT32",) if token_mode else ("BYTES",)
        if tensor.datatype not in expected and not (token_mode and tensor.datatype in ("INT32", "INT64", "UINT64")):
            raise InvalidRequestError(f"input '{tensor.name}': datatype must be {expected[0]}, got {tensor.datatype}",
                                      param="inputs")
        out_name = TOKEN_OUTPUT if token_mode else TEXT_OUTPUT
        binary_default = bool(params.binary_data_output)
        binary_out = binary_default
        for o in body.outputs or []:
            if o.name != out_name:
                raise InvalidRequestError(f"unexpected inference output '{o.name}' for model '{name}' (input "
                                          f"'{tensor.name}' gives '{out_name}')", param="outputs")
            oparams = o.parameters or {}
            if "shared_memory_region" in oparams:
                raise UnsupportedError(f"output '{o.name}': shared-memory outputs are not supported by this server")
            if oparams.get("classification"):
                raise UnsupportedError(f"output '{o.name}': classification outputs are not supported by this server")
            binary_out = bool(oparams.get("binary_data", binary_default))
        (values,) = read_inputs(body.inputs, binary)

        if token_mode:
            shape = list(tensor.shape)
            if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
                raise InvalidRequestError(f"input '{TOKEN_INPUT}': shape must be [n] or [1, n], got {shape}",
                                          param="inputs")
            if not values:
                raise InvalidRequestError(f"input '{TOKEN_INPUT}': no token ids", param="inputs")
            self.context.admission.check(1)
            res = await self._collect(self._request(params, ids=[int(v) for v in values], param=TOKEN_INPUT))
            data: list[Any] = res.token_ids
            out_shape = [1, len(data)] if len(shape) == 2 else [len(data)]
            datatype = "UINT32"
        else:
            texts = []
            for v in values:
                try:
                    texts.append(v.decode("utf-8"))
                except UnicodeDecodeError:
                    raise InvalidRequestError(f"input '{TEXT_INPUT}': not valid UTF-8 text", param="inputs") from None
            if not texts or any(not t for t in texts):
                raise InvalidRequestError(f"input '{TEXT_INPUT}': prompts must not be empty", param="inputs")
            self.context.admission.check(len(texts))  # before tokenizing
            reqs = [self._request(params, text=t) for t in texts]
            tasks = [asyncio.ensure_future(self._collect(r)) for r in reqs]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # one prompt failed: stop (and free) the others too
                    task.cancel()
                raise
            data = [r.text.encode("utf-8") for r in results]
            out_shape = list(tensor.shape)
            datatype = "BYTES"

        output: dict[str, Any] = {"name": out_name, "datatype": datatype, "shape": out_shape}
        reply: dict[str, Any] = {"model_name": name, "model_version": VERSION}
        if body.id is not None:
            reply["id"] = body.id
        reply["outputs"] = [output]
        if not binary_out:
            output["data"] = [d.decode("utf-8") for d in data] if datatype == "BYTES" else data
            return JSONResponse(reply)
        raw = encode_binary(datatype, data)
        output["parameters"] = {"binary_data_size": len(raw)}
        header = dumps(reply).encode("utf-8")
        return Response(header + raw, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(header))})

    # -- routes -------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        r = APIRouter()
        gen_body = openapi_body(GenerateBody)
        infer_body = openapi_body(InferBody, binary=True)
        M = "/v2/models/{model_name:path}"
        V = M + "/versions/{model_version}"

        @r.get("/v2")
        async def server_metadata() -> JSONResponse:
            return JSONResponse({"name": "llmserve", "version": __version__,
                                 "extensions": ["binary_tensor_data", "parameters", "model_configuration",
                                                "generate"]})

        @r.get("/v2/health/live")
        async def server_live() -> JSONResponse:
            engine = self.context.engine
            live = not (engine is not None and engine.is_dead)
            return JSONResponse({"live": live}, status_code=200 if live else 503)

        @r.get("/v2/health/ready")
        async def server_ready() -> JSONResponse:
            ready = self._ready()
            return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

        @r.post("/v2/repository/index", openapi_extra=openapi_body(RepositoryIndexBody))
        @self._guard
        async def repository_index(request: Request) -> JSONResponse:
            raw = await self._raw(request)
            body = parse_model(RepositoryIndexBody, load_json(raw)) if raw.strip() else RepositoryIndexBody()
            ready = self._ready()
            if body.ready and not ready:
                return JSONResponse([])
            state = "READY" if ready else "UNAVAILABLE"
            return JSONResponse([{"name": n, "version": VERSION, "state": state}
                                 for n in self.context.served_model_names])

        @r.get("/v2/models/stats")
        @self._guard
        async def all_stats() -> Response:
            return JSONResponse({"model_stats": [stats_entry(n, VERSION, self.context.metrics)
                                                 for n in self.context.served_model_names]})

        # Versioned routes first: "{model_name:path}" also matches ".../versions/1".
        for prefix in (V, M):
            self._model_routes(r, prefix, gen_body, infer_body)
        return r

    def _model_routes(self, r: APIRouter, prefix: str, gen_body: dict, infer_body: dict) -> None:
        versioned = prefix.endswith("{model_version}")
        tag = "_versioned" if versioned else ""

        async def model_ready(model_name: str, model_version: str | None = None) -> JSONResponse:
            name = self._model(model_name, model_version)
            ready = self._ready()
            return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)

        async def model_config(model_name: str, model_version: str | None = None) -> JSONResponse:
            return JSONResponse(self._config(self._model(model_name, model_version)))

        async def model_stats(model_name: str, model_version: str | None = None) -> Response:
            name = self._model(model_name, model_version)
            return JSONResponse({"model_stats": [stats_entry(name, VERSION, self.context.metrics)]})

        async def model_infer(request: Request, model_name: str, model_version: str | None = None) -> Response:
            return await self.infer(request, model_name, model_version)

        async def model_generate(request: Request, model_name: str, model_version: str | None = None) -> Response:
            return await self.generate(request, model_name, model_version, stream=False)

        async def model_generate_stream(request: Request, model_name: str,
                                        model_version: str | None = None) -> Response:
            return await self.generate(request, model_name, model_version, stream=True)

        async def model_metadata(model_name: str, model_version: str | None = None) -> JSONResponse:
            return JSONResponse(self._metadata(self._model(model_name, model_version)))

        routes = [("GET", "/ready", model_ready, None), ("GET", "/config", model_config, None),
                  ("GET", "/stats", model_stats, None), ("POST", "/infer", model_infer, infer_body),
                  ("POST", "/generate", model_generate, gen_body),
                  ("POST", "/generate_stream", model_generate_stream, gen_body),
                  ("GET", "", model_metadata, None)]  # last: it matches every longer path too
        for method, suffix, endpoint, extra in routes:
            endpoint.__name__ = endpoint.__name__ + tag
            r.add_api_route(prefix + suffix, guarded(self, endpoint), methods=[method], openapi_extra=extra,
                            responses=SSE_RESPONSES if suffix == "/generate_stream" else None)

    def _guard(self, endpoint: Any) -> Any:
        return guarded(self, endpoint)

    # -- errors -------------------------------------------------------------------------------
    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        """KServe's ``{"error": "<message>"}`` (tritonclient raises InferenceServerException from it)."""
        return JSONResponse({"error": error.message}, status_code=error.status, headers=error_headers(error))

