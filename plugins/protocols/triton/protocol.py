"""The Triton / KServe v2 dialect: health, model metadata and config, statistics, and the
routes of ``infer.py`` (JSON and binary tensors, token ids or text) and ``generate.py``
(the generate extension in MindIE's shape), with KServe's ``{"error": ...}`` errors."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import __version__
from llmserve import EngineDeadError, LLMServeError, NotFoundError
from llmserve import while_loading
from llmserve import PreparedRequest
from llmserve import dialect_router, load_json, parse_model
from llmserve import SSE_RESPONSES, openapi_body
from llmserve import Protocol

from ..mindie.events import first_sequence
from ..mindie.params import new_request
from .generate import Generate
from .host import Result
from .infer import Infer
from .stats import model_stats as stats_entry
from .tensors import decompress
from .wire import (
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOKEN_INPUT,
    TOKEN_OUTPUT,
    VERSION,
    GenerateBody,
    InferBody,
    RepositoryIndexBody,
)

PLATFORM = "llmserve"
# tritonclient sends binary tensors by default: the JSON header, then the raw bytes.
BINARY_BODY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}, "description": (
    "KServe binary tensor extension: the JSON header (length in the Inference-Header-Content-Length "
    "header) followed by the raw tensor bytes")}}


class TritonProtocol(Protocol):
    error_schema = {"title": "KServeError", "type": "object", "required": ["error"],
                    "properties": {"error": {"type": "string"}}}

    # -- what the endpoints share ---------------------------------------------------------------
    def check_model(self, name: str, version: str | None = None) -> str:
        """The name to answer under: ``name`` itself if it is served (any of its names), else the
        served name when the server accepts any name (``ServerContext.check_model``); and
        ``version`` must be the model's version."""
        ctx = self.context
        served = ctx.check_model(name, message=f"Request for unknown model: '{name}' is not found")
        if version not in (None, "", VERSION):
            raise NotFoundError(f"Request for unknown model: '{name}' version {version} is not found", param="model")
        return name if ctx.is_served(name) else served

    def ready(self) -> bool:
        ctx = self.context
        engine = ctx.engine
        return bool(ctx.ready and ctx.model is not None and engine is not None and not engine.is_dead)

    def engine(self) -> Any:
        engine = self.context.engine
        if engine is None or engine.is_dead:
            raise EngineDeadError("the model is not ready")
        return engine

    async def read_body(self, request: Request) -> bytes:
        """The body, inflated when tritonclient compressed it (capped like any body)."""
        return decompress(await request.body(), request.headers.get("content-encoding"),
                          self.context.config.http.max_request_body_bytes)

    async def new_request(self, params: Any, text: str | None = None, ids: list[int] | None = None,
                          param: str = TEXT_INPUT) -> PreparedRequest:
        """The prepared request (tokenized in a tokenizer thread, off the event loop)."""
        engine = self.engine()
        prepared, _ = await engine.in_worker(new_request, engine, params, text, ids, param)
        return prepared

    async def collect(self, req: PreparedRequest) -> Result:
        """Run ``req`` to the end; its text, token ids, finish reason and timings."""
        engine = self.engine()
        res = Result()
        async for event in engine.generate(req):
            ids, text, reason = first_sequence(event)
            res.text += text
            res.finish_reason = reason or res.finish_reason
            res.token_ids += ids
            res.clock.add(event, ids, engine)
            res.last = event
        return res

    # -- model metadata -------------------------------------------------------------------------
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

    # -- routes -------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        r = dialect_router(self)

        @r.get("/v2")
        async def server_metadata() -> JSONResponse:
            return JSONResponse({"name": "llmserve", "version": __version__,
                                 "extensions": ["binary_tensor_data", "parameters", "model_configuration",
                                                "generate"]})

        @r.get("/v2/health/live")
        @while_loading
        async def server_live() -> JSONResponse:
            engine = self.context.engine
            live = not (engine is not None and engine.is_dead)
            return JSONResponse({"live": live}, status_code=200 if live else 503)

        @r.get("/v2/health/ready")
        @while_loading
        async def server_ready() -> JSONResponse:
            ready = self.ready()
            return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

        @r.post("/v2/repository/index", openapi_extra=openapi_body(RepositoryIndexBody))
        async def repository_index(request: Request) -> JSONResponse:
            raw = await self.read_body(request)
            body = parse_model(RepositoryIndexBody, load_json(raw)) if raw.strip() else RepositoryIndexBody()
            ready = self.ready()
            if body.ready and not ready:
                return JSONResponse([])
            state = "READY" if ready else "UNAVAILABLE"
            return JSONResponse([{"name": n, "version": VERSION, "state": state}
                                 for n in self.context.served_model_names])

        @r.get("/v2/models/stats")
        async def all_stats() -> Response:
            return JSONResponse({"model_stats": [stats_entry(n, VERSION, self.context.metrics)
                                                 for n in self.context.served_model_names]})

        # Versioned routes first: "{model_name:path}" also matches ".../versions/1".
        model = "/v2/models/{model_name:path}"
        for prefix in (model + "/versions/{model_version}", model):
            self._model_routes(r, prefix)
        return r

    def _model_routes(self, r: APIRouter, prefix: str) -> None:
        tag = "_versioned" if prefix.endswith("{model_version}") else ""
        generate, infer = Generate(self), Infer(self)

        async def model_ready(model_name: str, model_version: str | None = None) -> JSONResponse:
            name = self.check_model(model_name, model_version)
            ready = self.ready()
            return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)

        async def model_config(model_name: str, model_version: str | None = None) -> JSONResponse:
            return JSONResponse(self._config(self.check_model(model_name, model_version)))

        async def model_stats(model_name: str, model_version: str | None = None) -> Response:
            name = self.check_model(model_name, model_version)
            return JSONResponse({"model_stats": [stats_entry(name, VERSION, self.context.metrics)]})

        async def model_infer(request: Request, model_name: str, model_version: str | None = None) -> Response:
            return await infer(request, model_name, model_version)

        async def model_generate(request: Request, model_name: str, model_version: str | None = None) -> Response:
            return await generate(request, model_name, model_version, stream=False)

        async def model_generate_stream(request: Request, model_name: str,
                                        model_version: str | None = None) -> Response:
            return await generate(request, model_name, model_version, stream=True)

        async def model_metadata(model_name: str, model_version: str | None = None) -> JSONResponse:
            return JSONResponse(self._metadata(self.check_model(model_name, model_version)))

        gen_body = openapi_body(GenerateBody)
        routes = [("GET", "/ready", model_ready, None), ("GET", "/config", model_config, None),
                  ("GET", "/stats", model_stats, None),
                  ("POST", "/infer", model_infer, openapi_body(InferBody, BINARY_BODY)),
                  ("POST", "/generate", model_generate, gen_body),
                  ("POST", "/generate_stream", model_generate_stream, gen_body),
                  ("GET", "", model_metadata, None)]  # last: it matches every longer path too
        for method, suffix, endpoint, extra in routes:
            endpoint.__name__ = endpoint.__name__ + tag
            r.add_api_route(prefix + suffix, endpoint, methods=[method], openapi_extra=extra,
                            responses=SSE_RESPONSES if suffix == "/generate_stream" else None)

    # -- errors -------------------------------------------------------------------------------
    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]:
        """KServe's ``{"error": "<message>"}`` (tritonclient raises InferenceServerException from it)."""
        return error.status, {"error": error.message}
