"""MindIE native dialect on the echo backend: /infer (text and stream), /v1/tokenizer, and every
validation rule with MindIE's error format ({"error", "error_type"} and its status texts)."""

from __future__ import annotations

import json

import pytest

from .wire_checks import break_after_first_event, json_error
from .wire_checks import sse_data as sse_events

ERROR_TYPES = {400: "Bad Request", 404: "NotFoundError", 405: "Bad Request", 422: "Input Validation Error",
               424: "Generation Error", 500: "Incomplete Generation", 503: "Service Unavailable"}


@pytest.fixture
def app(echo_app):
    return echo_app()


@pytest.fixture
def client(app):
    return app[0]


def assert_error(r, status: int, *needles: str) -> str:
    body = json_error(r, status, {"error", "error_type"}, needles)
    assert body["error_type"] == ERROR_TYPES[status], body
    return body["error"]


SPEC_PARAMETERS = {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
                   "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5, "watermark": False,
                   "priority": 5, "timeout": 10}


def test_infer_spec_example_non_stream(client):
    r = client.post("/infer", json={"inputs": "My name is Olivier and I", "stream": False,
                                    "parameters": SPEC_PARAMETERS})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"generated_text", "details"}
    assert body["generated_text"] == "My name is Olivier and I"[:20]
    d = body["details"]
    assert set(d) == {"finish_reason", "generated_tokens", "seed"}
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 20
    assert isinstance(d["seed"], int) and d["seed"] > 0  # sampled without a seed: a random one is reported


def test_infer_defaults_and_details(client):
    body = client.post("/infer", json={"inputs": "x" * 30}).json()
    assert body == {"generated_text": "x" * 20}  # max_new_tokens defaults to 20; no details unless asked
    d = client.post("/infer", json={"inputs": "hey", "parameters": {"details": True}}).json()["details"]
    assert d == {"finish_reason": "eos_token", "generated_tokens": 4, "seed": None}  # greedy, no seed
    d = client.post("/infer", json={"inputs": "hey", "parameters": {"details": True, "seed": 42, "do_sample": True}}
                    ).json()["details"]
    assert d["seed"] == 42
    d = client.post("/infer", json={"inputs": "hey", "parameters": {"details": True, "seed": 42, "do_sample": False}}
                    ).json()["details"]
    assert d["seed"] == 42
    body = client.post("/infer", json={"inputs": "ok", "stream": None, "parameters": None, "other": 1}).json()
    assert body == {"generated_text": "ok"}
    nulls = {k: None for k in SPEC_PARAMETERS}
    assert client.post("/infer", json={"inputs": "ok", "parameters": nulls}).json() == {"generated_text": "ok"}
    capped = client.post("/infer", json={"inputs": "abc", "parameters": {"max_new_tokens": 2147483647}})
    assert capped.json() == {"generated_text": "abc"}


def test_infer_stream_spec_shape(client):
    r = client.post("/infer", json={"inputs": "héllo", "stream": True, "parameters": SPEC_PARAMETERS})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    ids = list("héllo".encode()) + [256]
    assert len(events) == len(ids)
    first, last = events[0], events[-1]
    assert first["prefill_time"] >= 0 and first["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in events[1:])
    for e, tok in zip(events[:-1], ids):
        assert set(e) == {"prefill_time", "decode_time", "token"}
        assert e["token"]["id"] == [tok] and isinstance(e["token"]["text"], str)
    assert set(last) == {"prefill_time", "decode_time", "generated_text", "details", "token"}
    assert last["token"] == {"id": [256], "text": None}
    assert last["details"]["finish_reason"] == "eos_token" and last["details"]["generated_tokens"] == len(ids)
    non_stream = client.post("/infer", json={"inputs": "héllo"}).json()["generated_text"]
    assert last["generated_text"] == non_stream == "héllo"
    assert "".join(e["token"]["text"] for e in events[:-1]) == "héllo"


def test_infer_stream_length_and_no_details(client):
    events = sse_events(client.post("/infer", json={"inputs": "abcdef", "stream": True,
                                                    "parameters": {"max_new_tokens": 3}}).text)
    assert [e["token"]["id"] for e in events] == [[97], [98], [99]]
    assert events[-1]["token"]["text"] is None and events[-1]["generated_text"] == "abc"
    assert "details" not in events[-1]
    one = sse_events(client.post("/infer", json={"inputs": "a", "stream": True,
                                                 "parameters": {"max_new_tokens": 1, "details": True}}).text)
    assert len(one) == 1 and one[0]["prefill_time"] >= 0 and one[0]["decode_time"] is None
    assert one[0]["details"]["finish_reason"] == "length" and one[0]["generated_text"] == "a"


def test_infer_stream_error_after_start_is_in_band(app, monkeypatch):
    client, context = app
    break_after_first_event(monkeypatch, context.engine, "backend exploded")
    events = sse_events(client.post("/infer", json={"inputs": "hello", "stream": True}).text)
    assert events[0]["token"]["text"] == "h"
    assert events[-1] == {"error": "backend exploded", "error_type": "Incomplete Generation"}
    assert_error(client.post("/infer", json={"inputs": "hello"}), 500, "backend exploded")


def test_tokenizer(client):
    r = client.post("/v1/tokenizer", json={"inputs": "what is your name?"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"token_number", "tokens"}
    assert body["token_number"] == len("what is your name?") == len(body["tokens"])
    assert "".join(body["tokens"]) == "what is your name?"
    raw = client.post("/v1/tokenizer", json={"inputs": "ab", "do_decode": False}).json()
    assert raw == {"token_number": 2, "tokens": ["a", "b"]}
    assert client.post("/v1/tokenizer", json={"inputs": "ab", "do_decode": True, "x": 1}).json()["tokens"] == ["a", "b"]


INFER_INVALID = [
    ({}, "inputs"),
    ({"inputs": None}, "inputs"),
    ({"inputs": 5}, "inputs"),
    ({"inputs": ""}, "inputs"),
    ({"inputs": [{"type": "text", "text": "hi"}, {"type": "video_url", "video_url": "/x.mp4"}]}, "video_url"),
    ({"inputs": [{"type": "text", "text": ""}]}, "inputs.0.text"),
    ({"inputs": [{"kind": "text"}]}, "type is text or image_url"),
    ({"inputs": [{"type": "image_url", "image_url": "%%%"}]}, "base64"),
    ({"inputs": []}, "must not be empty"),
    ({"inputs": "x" * 600}, "maximum context length"),
    ({"inputs": "hi", "stream": "often"}, "stream"),
    ({"inputs": "hi", "parameters": "fast"}, "parameters"),
    ({"inputs": "hi", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"inputs": "hi", "parameters": {"temperature": 1e-6}}, "parameters.temperature"),
    ({"inputs": "hi", "parameters": {"top_k": 0}}, "parameters.top_k"),
    ({"inputs": "hi", "parameters": {"top_k": 2**31}}, "parameters.top_k"),
    ({"inputs": "hi", "parameters": {"top_p": 1.0}}, "parameters.top_p"),
    ({"inputs": "hi", "parameters": {"top_p": 1e-6}}, "parameters.top_p"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 2**31}}, "parameters.max_new_tokens"),
    ({"inputs": "hi", "parameters": {"do_sample": [True]}}, "parameters.do_sample"),
    ({"inputs": "hi", "parameters": {"seed": 0}}, "parameters.seed"),
    ({"inputs": "hi", "parameters": {"seed": 2**64}}, "parameters.seed"),
    ({"inputs": "hi", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
    ({"inputs": "hi", "parameters": {"details": {}}}, "parameters.details"),
    ({"inputs": "hi", "parameters": {"typical_p": 0}}, "parameters.typical_p"),
    ({"inputs": "hi", "parameters": {"typical_p": 1.01}}, "parameters.typical_p"),
    ({"inputs": "hi", "parameters": {"watermark": [1]}}, "parameters.watermark"),
    ({"inputs": "hi", "parameters": {"priority": 0}}, "parameters.priority"),
    ({"inputs": "hi", "parameters": {"priority": 6}}, "parameters.priority"),
    ({"inputs": "hi", "parameters": {"timeout": 0}}, "parameters.timeout"),
    ({"inputs": "hi", "parameters": {"timeout": 3601}}, "parameters.timeout"),
    ({"inputs": "hi", "parameters": {"timeout": 1.5}}, "parameters.timeout"),
    ({"inputs": "hi", "parameters": {"batch_size": 1e30}}, "parameters.batch_size"),
    ({"inputs": "hi", "parameters": {"batch_size": 0}}, "parameters.batch_size"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,needle", INFER_INVALID)
def test_infer_invalid_is_422_naming_the_field(client, body, needle, stream):
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    assert_error(client.post("/infer", json=body), 422, needle)


def test_infer_too_long_and_nan(client):
    assert_error(client.post("/infer", json={"inputs": "x" * (4 * 1024 * 1024 + 1)}), 422, "inputs")
    nan = b'{"inputs": "hi", "parameters": {"temperature": Infinity}}'
    assert_error(client.post("/infer", content=nan), 422, "parameters.temperature")


@pytest.mark.parametrize("path", ["/infer", "/v1/tokenizer"])
def test_malformed_bodies_are_400_bad_request(client, path):
    assert_error(client.post(path, content=b"{inputs"), 400, "not valid JSON")
    assert_error(client.post(path, content=b"\xff\xfe"), 400, "not valid JSON")
    assert_error(client.post(path, json=["inputs"]), 400, "JSON object")
    assert_error(client.post(path, content=b""), 400, "JSON object")
    assert_error(client.post(path, content=b"[" * 100000 + b"]" * 100000), 400, "nested too deeply")
    assert_error(client.get(path), 405)


@pytest.mark.parametrize("body,needle", [
    ({}, "inputs"), ({"inputs": ""}, "inputs"), ({"inputs": 7}, "inputs"), ({"inputs": ["a"]}, "inputs"),
    ({"inputs": "x" * 600}, "maximum input length"), ({"inputs": "a", "do_decode": "perhaps"}, "do_decode"),
])
def test_tokenizer_invalid_is_422(client, body, needle):
    assert_error(client.post("/v1/tokenizer", json=body), 422, needle)


def test_engine_dead_is_503(app):
    client, context = app
    loop = context.engine.loop
    loop.error = RuntimeError("boom")
    try:
        assert_error(client.post("/infer", json={"inputs": "hi"}), 503)
        assert_error(client.post("/infer", json={"inputs": "hi", "stream": True}), 503)
        assert_error(client.post("/v1/tokenizer", json={"inputs": "hi"}), 503)
    finally:
        loop.error = None


def test_openapi_documents_mindie_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path, field in (("/infer", "inputs"), ("/v1/tokenizer", "inputs")):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["required"], schema
    infer = json.dumps(paths["/infer"]["post"]["requestBody"])
    for name in ("temperature", "top_k", "top_p", "max_new_tokens", "do_sample", "seed", "repetition_penalty",
                 "details", "typical_p", "watermark", "priority", "timeout"):
        assert f'"{name}"' in infer, name
