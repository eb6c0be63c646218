"""``POST /v2/models/{m}/infer``: UINT32 ``input0`` token ids in, ``output0`` token ids out;
or BYTES ``text_input`` prompts in (a batch runs at once), ``text_output`` texts out. JSON or
binary tensors either way."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from llmserve import InvalidRequestError
from llmserve import UnsupportedError, dumps, parse_model

from .host import TritonHost
from .tensors import encode_binary, read_inputs, split_body
from .wire import (
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOKEN_INPUT,
    TOKEN_OUTPUT,
    VERSION,
    InferBody,
    InferTensor,
    SamplingParameters,
    check_id,
)


def check_io(body: InferBody, name: str) -> tuple[InferTensor, bool]:
    """The one input tensor and whether the reply is binary; refuses what this model does not serve."""
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
    return tensor, binary_out


class Infer:
    """The infer route of one ``TritonProtocol``."""

    def __init__(self, protocol: TritonHost) -> None:
        self.p = protocol

    async def __call__(self, request: Request, model_name: str, model_version: str | None) -> Response:
        raw = await self.p.read_body(request)  # read the body first, even when the reply is an error
        name = self.p.check_model(model_name, model_version)
        head, binary = split_body(raw, request.headers.get("inference-header-content-length"))
        body = parse_model(InferBody, head)
        check_id(body.id)
        tensor, binary_out = check_io(body, name)
        (values,) = read_inputs(body.inputs, binary)
        params = body.parameters or SamplingParameters()
        if tensor.name == TOKEN_INPUT:
            data, out_shape = await self._tokens(params, values, list(tensor.shape))
            out_name, datatype = TOKEN_OUTPUT, "UINT32"
        else:
            data, out_shape = await self._texts(params, values), list(tensor.shape)
            out_name, datatype = TEXT_OUTPUT, "BYTES"

        output: dict[str, Any] = {"name": out_name, "datatype": datatype, "shape": out_shape}
        reply: dict[str, Any] = {"model_name": name, "model_version": VERSION}
        if body.id is not None:
            reply["id"] = body.id
        reply["outputs"] = [output]
        if not binary_out:
            output["data"] = [d.decode("utf-8") for d in data] if datatype == "BYTES" else data
            return JSONResponse(reply)
        tensor_bytes = encode_binary(datatype, data)
        output["parameters"] = {"binary_data_size": len(tensor_bytes)}
        header = dumps(reply).encode("utf-8")
        return Response(header + tensor_bytes, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(header))})

    async def _tokens(self, params: SamplingParameters, values: list[Any],
                      shape: list[int]) -> tuple[list[Any], list[int]]:
        """Generated token ids for one prompt of token ids, shaped like the input ([n] or [1, n])."""
        if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
            raise InvalidRequestError(f"input '{TOKEN_INPUT}': shape must be [n] or [1, n], got {shape}",
                                      param="inputs")
        if not values:
            raise InvalidRequestError(f"input '{TOKEN_INPUT}': no token ids", param="inputs")
        self.p.context.admission.check(1)
        req = await self.p.new_request(params, ids=[int(v) for v in values], param=TOKEN_INPUT)
        res = await self.p.collect(req)
        data: list[Any] = res.token_ids
        return data, [1, len(data)] if len(shape) == 2 else [len(data)]

    async def _texts(self, params: SamplingParameters, values: list[Any]) -> list[Any]:
        """Generated texts (UTF-8 bytes) for a batch of prompts, run at once."""
        texts = []
        for v in values:
            try:
                texts.append(v.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidRequestError(f"input '{TEXT_INPUT}': not valid UTF-8 text", param="inputs") from None
        if not texts or any(not t for t in texts):
            raise InvalidRequestError(f"input '{TEXT_INPUT}': prompts must not be empty", param="inputs")
        self.p.context.admission.check(len(texts))  # before tokenizing
        reqs = [await self.p.new_request(params, text=t) for t in texts]
        tasks = [asyncio.ensure_future(self.p.collect(r)) for r in reqs]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one prompt failed: stop (and free) the others too
                task.cancel()
            raise
        return [r.text.encode("utf-8") for r in results]
