"""Triton / KServe v2 dialect on the echo backend: wire shapes, the binary tensor extension
(bodies built by hand), model names with '/', and every validation rule (status + format)."""

from __future__ import annotations

import gzip
import json
import struct
import zlib

import pytest

from .wire_checks import break_after_first_event, json_error
from .wire_checks import sse_data as sse_events

MODEL = "org/model"
BASE = f"/v2/models/{MODEL}"


@pytest.fixture
def app(echo_app):
    return echo_app(served_model_name=[MODEL], strict_model_name=True)  # unknown names are 404s


@pytest.fixture
def client(app):
    return app[0]


def assert_error(r, status: int, *needles: str) -> str:
    return json_error(r, status, {"error"}, needles)["error"]


# -- hand-built binary tensors ----------------------------------------------------------------
def bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def uint32_tensor(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def binary_body(header: dict, *blobs: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


def read_binary_reply(r) -> tuple[dict, dict[str, bytes]]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:n])
    rest, pos, blobs = r.content[n:], 0, {}
    for out in header["outputs"]:
        size = out["parameters"]["binary_data_size"]
        blobs[out["name"]] = rest[pos:pos + size]
        pos += size
    assert pos == len(rest)
    return header, blobs


def decode_bytes_tensor(blob: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(blob):
        (n,) = struct.unpack_from("<I", blob, pos)
        out.append(blob[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out


# -- server and model routes ------------------------------------------------------------------
def test_server_metadata_and_health(client):
    meta = client.get("/v2").json()
    assert meta["name"] == "llmserve" and meta["version"]
    assert isinstance(meta["extensions"], list) and "binary_tensor_data" in meta["extensions"]
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}


def test_health_not_ready_and_engine_dead(app):
    client, context = app
    context.ready = False
    try:
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get(f"{BASE}/ready").status_code == 503
        assert client.get("/v2/health/live").status_code == 200
    finally:
        context.ready = True
    loop = context.engine.loop
    loop.error = RuntimeError("boom")
    try:
        assert client.get("/v2/health/live").status_code == 503
        assert client.get("/v2/health/ready").json() == {"ready": False}
        assert_error(client.post(f"{BASE}/generate", json={"text_input": "hi"}), 503)
        assert_error(client.post(f"{BASE}/infer", json={"inputs": [
            {"name": "input0", "shape": [1], "datatype": "UINT32", "data": [104]}]}), 503)
    finally:
        loop.error = None


@pytest.mark.parametrize("path", [BASE, "/v2/models/org%2Fmodel", f"{BASE}/versions/1",
                                  "/v2/models/org%2Fmodel/versions/1"])
def test_model_metadata_with_slash_in_name(client, path):
    r = client.get(path)
    assert r.status_code == 200, r.text
    meta = r.json()
    assert meta["name"] == MODEL and meta["versions"] == ["1"] and meta["platform"]
    assert {(t["name"], t["datatype"]) for t in meta["inputs"]} == {("text_input", "BYTES"), ("input0", "UINT32")}
    assert {(t["name"], t["datatype"]) for t in meta["outputs"]} == {("text_output", "BYTES"), ("output0", "UINT32")}
    assert all(t["shape"] == [-1] for t in meta["inputs"] + meta["outputs"])


@pytest.mark.parametrize("suffix", ["", "/versions/1"])
def test_model_ready_and_config(client, suffix):
    assert client.get(f"{BASE}{suffix}/ready").json() == {"name": MODEL, "ready": True}
    assert client.get(f"/v2/models/org%2Fmodel{suffix}/ready").status_code == 200
    config = client.get(f"{BASE}{suffix}/config").json()
    assert config["name"] == MODEL and config["max_batch_size"] == 0
    assert [i["name"] for i in config["input"]] == ["text_input", "input0"]
    assert config["max_seq_len"] == 512 and config["input_datatype"] == "UINT32"


def test_served_name_without_slash_and_model_path(echo_app):
    client, _ = echo_app(strict_model_name=True)
    assert client.get("/v2/models/echo/ready").status_code == 200
    assert client.get("/v2/models/echo://").status_code == 200  # the model path is accepted too
    assert_error(client.get("/v2/models/org/model"), 404, "org/model")


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2/models/nope"), ("GET", "/v2/models/nope/ready"), ("GET", "/v2/models/nope/config"),
    ("GET", "/v2/models/org/other"), ("GET", f"{BASE}/versions/2"), ("GET", f"{BASE}/versions/2/ready"),
    ("POST", "/v2/models/nope/infer"), ("POST", "/v2/models/nope/generate"),
    ("POST", "/v2/models/nope/generate_stream"),
    ("POST", f"{BASE}/versions/7/generate"), ("GET", "/v2/models/nope/stats"),
])
def test_unknown_model_or_version_is_404(client, method, path):
    r = client.request(method, path, json={"text_input": "hi"})
    assert_error(r, 404, "unknown model")


def test_repository_index_and_wrong_methods(client):
    assert client.post("/v2/repository/index", content=b"").json() == [
        {"name": MODEL, "version": "1", "state": "READY"}]
    assert client.post("/v2/repository/index", json={"ready": True}).json()[0]["state"] == "READY"
    assert_error(client.post("/v2/repository/index", json={"ready": "maybe"}), 400, "ready")
    assert_error(client.post(f"{BASE}/ready"), 405)  # known path, wrong method: still the KServe format


# -- generate ---------------------------------------------------------------------------------
def test_generate_spec_shape(client):
    r = client.post(f"{BASE}/generate", json={"id": "a123", "text_input": "hello world", "parameters": {
        "details": True, "max_new_tokens": 5, "perf_stat": True, "batch_size": 100, "priority": 5, "timeout": 10}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"] == "a123" and body["model_name"] == MODEL and body["model_version"] is None
    assert body["text_output"] == "hello"
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 5
    assert d["first_token_cost"] is None and d["decode_cost"] is None
    assert [t for t, _ in d["perf_stat"]] == list(b"hello") and all(isinstance(ms, int) for _, ms in d["perf_stat"])
    assert d["batch_size"] >= 1 and isinstance(d["queue_wait_time"], int) and d["queue_wait_time"] >= 0
    assert d["prefill_time"] >= 0 and d["decode_time"] >= 0


def test_generate_defaults_and_eos(client):
    body = client.post(f"{BASE}/generate", json={"text_input": "hey"}).json()
    assert body["text_output"] == "hey" and "details" not in body and len(body["id"]) == 32
    d = client.post(f"{BASE}/generate", json={"text_input": "hey", "parameters": {"details": True}}).json()["details"]
    assert d["finish_reason"] == "eos_token" and d["generated_tokens"] == 4 and "perf_stat" not in d
    d = client.post(f"{BASE}/generate", json={"text_input": "hey", "parameters": {"perf_stat": True}}).json()["details"]
    assert len(d["perf_stat"]) == 4
    long = client.post(f"{BASE}/generate", json={"text_input": "x" * 40}).json()
    assert long["text_output"] == "x" * 20  # max_new_tokens defaults to 20


def test_generate_accepts_nulls_unknown_keys_and_top_level_parameters(client):
    params = {k: None for k in ("details", "do_sample", "max_new_tokens", "repetition_penalty", "seed", "temperature",
                                "top_k", "top_p", "batch_size", "typical_p", "watermark", "perf_stat", "priority",
                                "timeout")}
    r = client.post(f"{BASE}/generate", json={"id": None, "text_input": "ok", "parameters": {**params, "stop": ["x"]},
                                             "extra": 1})
    assert r.status_code == 200 and r.json()["text_output"] == "ok"
    assert client.post(f"{BASE}/generate", json={"text_input": "abcdef", "max_tokens": 2}).json()["text_output"] == "ab"
    assert client.post(f"{BASE}/generate", json={"text_input": "abcdef", "max_new_tokens": 3, "parameters": None}
                       ).json()["text_output"] == "abc"
    r = client.post(f"{BASE}/generate", json={"text_input": "abcdef", "max_new_tokens": 3,
                                             "parameters": {"max_new_tokens": 1}})
    assert r.json()["text_output"] == "a"  # `parameters` wins over the top level
    r = client.post(f"{BASE}/generate", json={"text_input": "abcdef", "parameters": {
        "watermark": True, "do_sample": True, "seed": 7, "temperature": 0.5, "top_k": 5, "top_p": 0.9,
        "typical_p": 0.5, "repetition_penalty": 1.1}})
    assert r.status_code == 200  # the echo backend ignores sampling; the values are valid


def test_generate_max_new_tokens_is_capped_to_the_context(client):
    r = client.post(f"{BASE}/generate", json={"text_input": "abc", "parameters": {"max_new_tokens": 2147483647}})
    assert r.status_code == 200 and r.json()["text_output"] == "abc"


def test_generate_stream_spec_shape(client):
    r = client.post(f"{BASE}/generate_stream", json={"id": "a123", "text_input": "hello", "parameters": {
        "details": True, "perf_stat": True, "max_new_tokens": 4}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len(events) == 4
    assert "".join(e["text_output"] for e in events) == "hell"
    for i, e in enumerate(events, 1):
        assert e["id"] == "a123" and e["model_name"] == MODEL and e["model_version"] is None
        d = e["details"]
        assert d["generated_tokens"] == i and len(d["perf_stat"]) == i
        assert d["first_token_cost"] is None and d["decode_cost"] is None and d["batch_size"] >= 1
        assert isinstance(d["queue_wait_time"], int)
        assert ("finish_reason" in d) == (i == 4)
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[0]["prefill_time"] >= 0 and events[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in events[1:])


def test_generate_stream_without_details_equals_non_stream(client):
    events = sse_events(client.post(f"{BASE}/generate_stream", json={"text_input": "héllo"}).text)
    assert all("details" not in e for e in events)
    text = client.post(f"{BASE}/generate", json={"text_input": "héllo"}).json()["text_output"]
    assert "".join(e["text_output"] for e in events) == text == "héllo"
    assert len(events) == len("héllo".encode()) + 1  # one event per token, EOS included


def test_generate_stream_error_after_start_is_in_band(app, monkeypatch):
    client, context = app
    break_after_first_event(monkeypatch, context.engine, "backend exploded")
    r = client.post(f"{BASE}/generate_stream", json={"text_input": "hello"})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[0]["text_output"] == "h" and events[-1] == {"error": "backend exploded"}
    r = client.post(f"{BASE}/generate", json={"text_input": "hello"})
    assert_error(r, 500, "backend exploded")


GENERATE_INVALID = [
    ({"parameters": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"parameters": {"max_new_tokens": 2**31}}, "max_new_tokens"),
    ({"parameters": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"parameters": {"seed": 0}}, "seed"),
    ({"parameters": {"seed": 2**64}}, "seed"),
    ({"parameters": {"temperature": 0}}, "temperature"),
    ({"parameters": {"temperature": 1e-6}}, "temperature"),
    ({"parameters": {"top_k": -1}}, "top_k"),
    ({"parameters": {"top_k": 2**31}}, "top_k"),
    ({"parameters": {"top_p": 1e-6}}, "top_p"),
    ({"parameters": {"top_p": 1.01}}, "top_p"),
    ({"parameters": {"batch_size": 0}}, "batch_size"),
    ({"parameters": {"typical_p": 0}}, "typical_p"),
    ({"parameters": {"typical_p": 1.5}}, "typical_p"),
    ({"parameters": {"priority": 0}}, "priority"),
    ({"parameters": {"priority": 6}}, "priority"),
    ({"parameters": {"timeout": 0}}, "timeout"),
    ({"parameters": {"timeout": 3601}}, "timeout"),
    ({"parameters": {"details": [1]}}, "details"),
    ({"parameters": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"parameters": [1]}, "parameters"),
    ({"max_tokens": 0}, "max_new_tokens"),
    ({"id": "a b"}, "id"),
    ({"id": ""}, "id"),
    ({"id": "x" * 257}, "id"),
    ({"text_input": ""}, "text_input"),
    ({"text_input": None}, "text_input"),
    ({"text_input": 5}, "text_input"),
    ({"text_input": "x" * 600}, "maximum context length"),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize("change,needle", GENERATE_INVALID)
def test_generate_invalid_is_400_naming_the_field(client, route, change, needle):
    body = {"text_input": "hello", **change}
    assert_error(client.post(f"{BASE}/{route}", json=body), 400, needle)


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_generate_malformed_bodies(client, route):
    assert_error(client.post(f"{BASE}/{route}", content=b"{nope"), 400, "not valid JSON")
    assert_error(client.post(f"{BASE}/{route}", json=["text_input"]), 400, "JSON object")
    assert_error(client.post(f"{BASE}/{route}", content=b""), 400, "JSON object")
    assert_error(client.post(f"{BASE}/{route}", json={}), 400, "text_input")
    nan = b'{"text_input": "hi", "parameters": {"temperature": NaN}}'
    assert_error(client.post(f"{BASE}/{route}", content=nan), 400, "temperature")
    assert_error(client.post(f"{BASE}/{route}", content=b"[" * 100000 + b"]" * 100000), 400, "nested too deeply")
    too_long = {"text_input": "x" * (4 * 1024 * 1024 + 1)}
    assert_error(client.post(f"{BASE}/{route}", json=too_long), 400, "text_input")
    multimodal = {"text_input": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "/x.png"}]}
    assert_error(client.post(f"{BASE}/{route}", json=multimodal), 400, "multimodal")


# -- infer: JSON ------------------------------------------------------------------------------
def token_infer(ids, shape=None, **extra):
    return {"inputs": [{"name": "input0", "shape": shape or [1, len(ids)], "datatype": "UINT32", "data": ids}],
            **extra}


def test_token_infer_spec_shape(client):
    body = token_infer([104, 105, 33], id="42", outputs=[{"name": "output0"}],
                       parameters={"temperature": 0.5, "top_k": 10, "top_p": 0.95, "do_sample": True, "seed": None,
                                   "repetition_penalty": 1.03, "max_new_tokens": 20, "watermark": True,
                                   "priority": 5, "timeout": 10})
    r = client.post(f"{BASE}/infer", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    out = r.json()
    assert out["id"] == "42" and out["model_name"] == MODEL and out["model_version"] == "1"
    assert out["outputs"] == [{"name": "output0", "datatype": "UINT32", "shape": [1, 4], "data": [104, 105, 33, 256]}]


def test_token_infer_shapes_and_limits(client):
    out = client.post(f"{BASE}/infer", json=token_infer([104, 105], shape=[2])).json()
    assert out["outputs"][0]["shape"] == [3] and "id" not in out
    body = token_infer([[104, 105, 106]], shape=[1, 3], parameters={"max_new_tokens": 2})
    out = client.post(f"{BASE}/infer", json=body).json()
    assert out["outputs"][0]["data"] == [104, 105]  # nested data is read row-major
    for dtype in ("INT32", "INT64"):  # numpy's default integer types are accepted too
        body = {"inputs": [{"name": "input0", "shape": [1], "datatype": dtype, "data": [104]}]}
        assert client.post(f"{BASE}/infer", json=body).json()["outputs"][0]["data"] == [104, 256]


def test_text_infer_json(client):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hello"]}],
            "outputs": [{"name": "text_output", "parameters": {"binary_data": False}}],
            "parameters": {"max_new_tokens": 3}}
    out = client.post(f"{BASE}/infer", json=body).json()
    assert out["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["hel"]}]
    body = {"inputs": [{"name": "text_input", "shape": [1, 2], "datatype": "BYTES", "data": [["ab", "cd"]]}]}
    out = client.post(f"{BASE}/infer", json=body).json()
    assert out["outputs"][0]["shape"] == [1, 2] and out["outputs"][0]["data"] == ["ab", "cd"]


# -- infer: binary tensor extension -----------------------------------------------------------
def test_binary_text_input_and_binary_output(client):
    prompts = [b"hello", "h\u00e9".encode()]
    header = {"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES",
                          "parameters": {"binary_data_size": len(bytes_tensor(prompts))}}],
              "parameters": {"binary_data_output": True}}
    content, headers = binary_body(header, bytes_tensor(prompts))
    r = client.post(f"{BASE}/infer", content=content, headers=headers)
    reply, blobs = read_binary_reply(r)
    out = reply["outputs"][0]
    assert out["name"] == "text_output" and out["datatype"] == "BYTES" and out["shape"] == [2] and "data" not in out
    assert decode_bytes_tensor(blobs["text_output"]) == prompts


def test_binary_token_input_json_output(client):
    ids = [104, 105, 33]
    header = {"id": "7", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                     "parameters": {"binary_data_size": 12}}],
              "outputs": [{"name": "output0", "parameters": {"binary_data": False}}]}
    content, headers = binary_body(header, uint32_tensor(ids))
    r = client.post(f"{BASE}/infer", content=content, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["outputs"][0]["data"] == ids + [256]


def test_binary_output_per_output_flag_overrides_request_default(client):
    body = token_infer([104, 105], outputs=[{"name": "output0", "parameters": {"binary_data": True}}],
                       parameters={"binary_data_output": False})
    reply, blobs = read_binary_reply(client.post(f"{BASE}/infer", json=body))
    assert reply["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert struct.unpack("<3I", blobs["output0"]) == (104, 105, 256)
    body = token_infer([104], outputs=[{"name": "output0"}], parameters={"binary_data_output": True})
    assert read_binary_reply(client.post(f"{BASE}/infer", json=body))[1]["output0"] == uint32_tensor([104, 256])
    # no `outputs` at all (what tritonclient sends then: binary_data_output=true)
    body = token_infer([104], parameters={"binary_data_output": True})
    assert read_binary_reply(client.post(f"{BASE}/infer", json=body))[1]["output0"] == uint32_tensor([104, 256])


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_binary_request(client, encoding, compress):
    header = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                          "parameters": {"binary_data_size": 7}}],
              "outputs": [{"name": "text_output", "parameters": {"binary_data": False}}]}
    content, headers = binary_body(header, bytes_tensor([b"zip"]))
    r = client.post(f"{BASE}/infer", content=compress(content), headers={**headers, "Content-Encoding": encoding})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == ["zip"]


def _bin(name, dtype, size, shape=(1,)):
    return {"name": name, "shape": list(shape), "datatype": dtype, "parameters": {"binary_data_size": size}}


@pytest.mark.parametrize("header,blob,status,needle", [
    ({"inputs": [_bin("input0", "UINT32", 16)]}, uint32_tensor([104]), 400, "runs past the end"),
    ({"inputs": [_bin("input0", "UINT32", 4)]}, uint32_tensor([104, 105]), 400, "no input claims"),
    ({"inputs": [_bin("input0", "UINT32", 3)]}, b"abc", 400, "whole number"),
    ({"inputs": [_bin("input0", "UINT32", -1)]}, b"", 400, "binary_data_size"),
    ({"inputs": [_bin("input0", "UINT32", 8)]}, uint32_tensor([104, 105]), 400, "holds 1 elements"),
    ({"inputs": [_bin("text_input", "BYTES", 3)]}, b"\x05\x00\x00", 400, "truncated"),
    ({"inputs": [_bin("text_input", "BYTES", 6)]}, b"\x09\x00\x00\x00ab", 400, "runs past the end"),
    ({"inputs": [_bin("text_input", "BYTES", 6)]}, bytes_tensor([b"\xff\xfe"]), 400, "UTF-8"),
    ({"inputs": [_bin("text_input", "BYTES", 4)]}, bytes_tensor([b""]), 400, "must not be empty"),
    ({"inputs": [_bin("input0", "UINT32", 4)]}, uint32_tensor([300]), 400, "out of vocabulary"),
])
def test_binary_input_errors(client, header, blob, status, needle):
    content, headers = binary_body(header, blob)
    assert_error(client.post(f"{BASE}/infer", content=content, headers=headers), status, needle)


def test_binary_header_length_errors(client):
    head = json.dumps(token_infer([104])).encode()
    for bad in ("abc", str(len(head) + 1), "-1"):
        r = client.post(f"{BASE}/infer", content=head, headers={"Inference-Header-Content-Length": bad})
        assert_error(r, 400, "Inference-Header-Content-Length")
    r = client.post(f"{BASE}/infer", content=head[:5] + b"xx", headers={"Inference-Header-Content-Length": "5"})
    assert_error(r, 400, "not valid JSON")
    assert_error(client.post(f"{BASE}/infer", content=b"\x00\x01", headers={"Content-Encoding": "gzip"}), 400, "gzip")
    assert_error(client.post(f"{BASE}/infer", content=head, headers={"Content-Encoding": "br"}), 400, "br")


INFER_INVALID = [
    ({}, 400, "inputs"),
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": [{"name": "foo", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, 400,
     "unexpected inference input 'foo'"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1]},
                 {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, 400, "exactly one input"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1]}] * 2}, 400, "only once"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400, "UINT32"),
    ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "UINT32", "data": [1]}]}, 400, "BYTES"),
    ({"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [104]}]}, 400, "holds 3 elements"),
    ({"inputs": [{"name": "input0", "shape": [2, 1], "datatype": "UINT32", "data": [104, 105]}]}, 400, "[n] or [1, n]"),
    ({"inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32", "data": [104]}]}, 400, "inputs.0.shape"),
    ({"inputs": [{"name": "input0", "shape": [1, 0], "datatype": "UINT32", "data": []}]}, 400, "no token ids"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": ["104"]}]}, 400, "integers"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1.5]}]}, 400, "integers"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [-1]}]}, 400, "out of range"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [999]}]}, 400, "out of vocabulary"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32"}]}, 400, "no data"),
    ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [5]}]}, 400, "JSON strings"),
    ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [""]}]}, 400, "must not be empty"),
    ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x" * 600]}]}, 400,
     "context length"),
    ({"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32",
                  "parameters": {"shared_memory_region": "r"}}]}, 400, "shared-memory"),
    ({**token_infer([1]), "outputs": [{"name": "text_output"}]}, 400, "unexpected inference output 'text_output'"),
    ({**token_infer([1]), "outputs": [{"name": "output0", "parameters": {"shared_memory_region": "r"}}]}, 400,
     "shared-memory"),
    ({**token_infer([1]), "outputs": [{"name": "output0", "parameters": {"classification": 2}}]}, 400,
     "classification"),
    ({**token_infer([1]), "id": "bad id!"}, 400, "id"),
    ({**token_infer([1]), "parameters": {"temperature": 0}}, 400, "parameters.temperature"),
    ({**token_infer([1]), "parameters": {"top_k": -1}}, 400, "parameters.top_k"),
    ({**token_infer([1]), "parameters": {"top_p": 0}}, 400, "parameters.top_p"),
    ({**token_infer([1]), "parameters": {"seed": 0}}, 400, "parameters.seed"),
    ({**token_infer([1]), "parameters": {"repetition_penalty": -1}}, 400, "parameters.repetition_penalty"),
    ({**token_infer([1]), "parameters": {"max_new_tokens": 0}}, 400, "parameters.max_new_tokens"),
    ({**token_infer([1]), "parameters": {"batch_size": 0}}, 400, "parameters.batch_size"),
    ({**token_infer([1]), "parameters": {"priority": 6}}, 400, "parameters.priority"),
    ({**token_infer([1]), "parameters": {"timeout": 3601}}, 400, "parameters.timeout"),
    ({**token_infer([1]), "parameters": "fast"}, 400, "parameters"),
]


@pytest.mark.parametrize("body,status,needle", INFER_INVALID)
def test_infer_invalid(client, body, status, needle):
    assert_error(client.post(f"{BASE}/infer", json=body), status, needle)


def test_infer_malformed(client):
    assert_error(client.post(f"{BASE}/infer", content=b"not json"), 400, "not valid JSON")
    assert_error(client.post(f"{BASE}/infer", json=[1]), 400, "JSON object")
    body = {"inputs": [{"name": "input0", "shape": [1], "datatype": "UINT32", "data": [1]}], "outputs": "all"}
    assert_error(client.post(f"{BASE}/infer", json=body), 400, "outputs")


def test_openapi_documents_every_triton_route_with_a_body_schema(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for p in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{model_name}",
              "/v2/models/{model_name}/versions/{model_version}", "/v2/models/{model_name}/ready",
              "/v2/models/{model_name}/config"):
        assert "get" in paths[p], p
    for action in ("infer", "generate", "generate_stream"):
        for p in (f"/v2/models/{{model_name}}/{action}",
                  f"/v2/models/{{model_name}}/versions/{{model_version}}/{action}"):
            schema = paths[p]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert schema["type"] == "object" and schema["properties"], p
    gen = paths["/v2/models/{model_name}/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "text_input" in gen["required"] and "timeout" in json.dumps(gen)
    assert "application/octet-stream" in paths["/v2/models/{model_name}/infer"]["post"]["requestBody"]["content"]
    assert '"#/$defs' not in json.dumps(spec)


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_body_that_inflates_past_the_limit_is_413(echo_app, encoding, compress):
    client, _ = echo_app(served_model_name=[MODEL], max_request_body_bytes=64 * 1024)
    bomb = compress(b"\x00" * (2 * 1024 * 1024))  # 2 MiB of zeros in a few KiB
    assert len(bomb) < 64 * 1024
    r = client.post(f"{BASE}/infer", content=bomb, headers={"Content-Encoding": encoding,
                                                            "Content-Type": "application/octet-stream"})
    assert_error(r, 413, "inflates to more than 65536 bytes")
    r = client.post(f"{BASE}/infer", content=compress(b"{" * 10), headers={"Content-Encoding": encoding})
    assert_error(r, 400)  # small bodies still inflate and then parse (here: not JSON)


def test_truncated_gzip_body_is_400(client):
    data = gzip.compress(json.dumps(token_infer([104])).encode())
    r = client.post(f"{BASE}/infer", content=data[:-12], headers={"Content-Encoding": "gzip"})
    assert_error(r, 400, "gzip")


def test_statistics_count_finished_requests(client):
    def entry(path):
        r = client.get(path)
        assert r.status_code == 200, r.text
        (stats,) = r.json()["model_stats"]
        return stats

    before = entry(f"{BASE}/stats")
    assert before["name"] == MODEL and before["version"] == "1"
    assert client.post(f"{BASE}/generate", json={"text_input": "hey"}).status_code == 200
    after = entry("/v2/models/stats")
    assert after["inference_count"] == before["inference_count"] + 1
    success = after["inference_stats"]["success"]
    assert success["count"] == after["inference_count"] and success["ns"] > 0
    assert after["last_inference"] > 0 and after["inference_stats"]["queue"]["count"] >= 1
    assert_error(client.get("/v2/models/other/stats"), 404, "unknown model")
