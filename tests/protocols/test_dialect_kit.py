"""The dialect kit (``llmserve.server.dialect_kit``): one NaN policy, one SSE framing and one
error path for every dialect."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from conftest import ECHO_PLUGIN


@pytest.fixture
def client(echo_app):
    c, _ = echo_app()
    return c


# -- NaN and Infinity: JSON has neither, every dialect refuses them naming the field ----------
NAN_BODIES = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400,
     lambda b: b["error"]["param"] == "temperature" and "finite" in b["error"]["message"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}',
     400, lambda b: b["error"]["param"] == "presence_penalty" and "finite" in b["error"]["message"]),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', 400,
     lambda b: b["error"]["param"].startswith("logit_bias") and "finite" in b["error"]["message"]),
    # TGI's range check has no upper bound here: before the kit this request ran with +inf.
    ("/generate", b'{"inputs": "hi", "parameters": {"repetition_penalty": Infinity}}', 422,
     lambda b: b == {"error": "Input validation error: parameters.repetition_penalty: Input should be a "
                              "finite number", "error_type": "validation"}),
    ("/", b'{"inputs": "hi", "parameters": {"top_p": NaN}}', 422,
     lambda b: b["error_type"] == "validation" and "parameters.top_p" in b["error"]),
    ("/generate", b'{"prompt": "hi", "top_p": NaN}', 400,
     lambda b: b["error"]["param"] == "top_p" and "finite" in b["error"]["message"]),
    ("/infer", b'{"inputs": "hi", "parameters": {"temperature": Infinity}}', 422,
     lambda b: b["error_type"] == "Input Validation Error" and "parameters.temperature" in b["error"]),
    ("/v2/models/echo/generate", b'{"text_input": "hi", "parameters": {"top_p": NaN}}', 400,
     lambda b: "parameters.top_p" in b["error"] and "finite" in b["error"]),
]


@pytest.mark.parametrize(("path", "raw", "status", "check"), NAN_BODIES, ids=[b[0] + str(i) for i, b in
                                                                               enumerate(NAN_BODIES)])
def test_non_finite_numbers_are_refused_in_the_dialects_format(client, path, raw, status, check):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert check(r.json()), r.text


def test_one_wire_model_base_for_every_dialect():
    from llmserve.plugins.protocols.mindie.wire import InferBody
    from llmserve.plugins.protocols.openai.wire import ChatCompletionRequest
    from llmserve.plugins.protocols.tgi.wire import TGIGenerateRequest
    from llmserve.plugins.protocols.triton.wire import GenerateBody
    from llmserve.plugins.protocols.vllm_native.wire import VLLMGenerateRequest
    from llmserve.server.dialect_kit import WireModel

    for model in (ChatCompletionRequest, TGIGenerateRequest, VLLMGenerateRequest, InferBody, GenerateBody):
        assert issubclass(model, WireModel), model


# -- SSE framing --------------------------------------------------------------------------------
def test_sse_framing_and_encoding():
    from llmserve.server.dialect_kit import SSE_DONE, dumps, sse

    assert sse({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'
    assert sse({"type": "ping"}, event="ping") == 'event: ping\ndata: {"type":"ping"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})


def test_in_band_errors_end_the_stream_in_the_dialects_format_and_close_the_source():
    from llmserve.errors import OverloadedError
    from llmserve.server.dialect_kit import in_band_errors, sse
    from llmserve.server.protocol import Protocol

    class Acme(Protocol):
        def router(self):  # pragma: no cover - not served
            raise NotImplementedError

        def error_body(self, error):
            return error.status, {"acme_error": error.message}

    closed = []

    async def events():
        try:
            yield sse({"n": 1})
            raise OverloadedError("busy")
        finally:
            closed.append(True)

    async def run(limit=None):
        out = []
        stream = in_band_errors(Acme(None), events(), sse)
        async for item in stream:
            out.append(item)
            if limit and len(out) == limit:
                await stream.aclose()
                break
        return out

    assert asyncio.run(run()) == ['data: {"n":1}\n\n', 'data: {"acme_error":"busy"}\n\n']
    closed.clear()
    assert asyncio.run(run(limit=1)) == ['data: {"n":1}\n\n'] and closed == [True]  # a client that leaves


# -- one error path -----------------------------------------------------------------------------
BOOM = textwrap.dedent("""
    from fastapi import APIRouter
    from llmserve import hookimpl
    from llmserve.hooks.records import ProtocolSpec
    from llmserve.server.dialect_kit import dialect_router
    from llmserve.server.protocol import Protocol

    class Boom(Protocol):
        error_schema = {"type": "object", "properties": {"boom": {"type": "string"}}}

        def router(self):
            r = ROUTER
            @r.get("/boom/{kind}")
            async def boom(kind: str, n: int = 0):
                raise {"runtime": RuntimeError, "key": KeyError}[kind]("secret detail")
            return r

        def error_body(self, error):
            return error.status, {"boom": error.message}

    @hookimpl
    def register_protocols():
        return [ProtocolSpec(name="boom", target=__name__ + ":Boom")]
""")


@pytest.mark.parametrize("router", ["dialect_router(self)", "APIRouter()"])
def test_every_error_of_a_dialect_route_is_rendered_there(tmp_path, router):
    """An unexpected exception answers in the dialect's format and never reaches the server's
    last-resort handler (which would re-raise: a logged traceback and a dropped connection),
    whether the plugin built its router with the kit or as a plain ``APIRouter``."""
    from fastapi.testclient import TestClient

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    plugin = tmp_path / "boom_plugin.py"
    plugin.write_text(BOOM.replace("ROUTER", router))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(plugin)]}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=True) as client:  # a re-raise would fail the call
        for kind in ("runtime", "key"):
            r = client.get(f"/boom/{kind}")
            assert r.status_code == 500 and r.json() == {"boom": "internal server error"}
        r = client.get("/boom/runtime", params={"n": "x"})  # validation errors take the same path
        assert r.status_code == 400 and r.json() == {"boom": "query.n: Input should be a valid integer, unable "
                                                              "to parse string as an integer"}


def test_built_in_dialects_route_through_the_kit(client):
    """Every route of a built-in dialect is a DialectRoute bound to its protocol."""
    from fastapi.routing import APIRoute

    from llmserve.server.dialect_kit import DialectRoute

    protocols = client.app.state.protocols
    for name, protocol in protocols.items():
        routes = [r for r in protocol.router().routes if isinstance(r, APIRoute)]
        assert all(isinstance(r, DialectRoute) and r.protocol is protocol for r in routes), name


def test_malformed_shared_body_in_the_first_dialects_format(client):
    r = client.post("/generate", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "nested too deeply" in r.json()["error"] or "not valid JSON" in r.json()["error"]
    assert json.loads(client.post("/generate", content=b"{oops").text)["error"] == \
        "Input validation error: request body is not valid JSON"
