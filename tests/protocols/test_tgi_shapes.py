"""TGI dialect on the echo backend (fast): wire shapes, stream framing, every validation rule.

The echo backend generates the prompt back byte by byte, then EOS (id 256, text ``</s>``).
"""

import json
import math

import pytest

from llmserve.errors import EngineDeadError, GenerationError, InvalidRequestError, OverloadedError

from .wire_checks import break_after_first_event, sse_data

# What text-generation 0.7.0 sends: every parameter, most of them null.
TEXT_GENERATION_PARAMS = {
    "best_of": None, "details": True, "decoder_input_details": False, "do_sample": False, "max_new_tokens": 20,
    "repetition_penalty": None, "frequency_penalty": None, "return_full_text": False, "stop": [], "seed": None,
    "temperature": None, "top_k": None, "top_p": None, "truncate": None, "typical_p": None, "watermark": False,
    "top_n_tokens": None, "grammar": None, "adapter_id": None,
}


def sse_events(response):
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    return sse_data(response.text)


@pytest.fixture
def client(echo_app):
    c, _ = echo_app()
    return c


def gen(client, inputs="hello", path="/generate", **params):
    return client.post(path, json={"inputs": inputs, "parameters": params})


# -- shapes ------------------------------------------------------------------------------------
def test_compat_root_returns_a_list_with_details(client):
    r = client.post("/", json={"inputs": "hello", "parameters": TEXT_GENERATION_PARAMS})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert isinstance(body, list) and len(body) == 1
    out = body[0]
    assert out["generated_text"] == "hello"
    d = out["details"]
    assert d["finish_reason"] == "eos_token" and d["generated_tokens"] == 6
    assert d["seed"] is None and d["prefill"] == []
    assert "top_tokens" not in d and "best_of_sequences" not in d
    assert [t["id"] for t in d["tokens"]] == [104, 101, 108, 108, 111, 256]
    for t in d["tokens"]:
        assert set(t) == {"id", "text", "logprob", "special"}
        assert isinstance(t["special"], bool) and isinstance(t["logprob"], float)
    assert d["tokens"][-1] == {"id": 256, "text": "</s>", "logprob": -0.5, "special": True}
    assert "".join(t["text"] for t in d["tokens"] if not t["special"]) == out["generated_text"]
    assert r.headers["x-generated-tokens"] == "6" and r.headers["x-prompt-tokens"] == "5"


def test_generate_returns_an_object_and_omits_details_by_default(client):
    r = gen(client, "abc")
    assert r.status_code == 200
    assert r.json() == {"generated_text": "abc"}


def test_return_full_text_prepends_the_inputs(client):
    assert gen(client, "abc", return_full_text=True).json()["generated_text"] == "abcabc"
    r = client.post("/", json={"inputs": "abc", "parameters": {"return_full_text": True}})
    assert r.json() == [{"generated_text": "abcabc"}]


def test_max_new_tokens_gives_length(client):
    d = gen(client, "abcdef", max_new_tokens=3, details=True).json()
    assert d["generated_text"] == "abc"
    assert d["details"]["finish_reason"] == "length" and d["details"]["generated_tokens"] == 3


def test_default_max_new_tokens_is_20(client):
    d = gen(client, "x" * 40, details=True).json()["details"]
    assert d["generated_tokens"] == 20 and d["finish_reason"] == "length"


def test_stop_sequence_is_kept_in_the_text(client):
    d = gen(client, "hello world", stop=["lo"], details=True).json()
    assert d["generated_text"] == "hello"
    assert d["details"]["finish_reason"] == "stop_sequence"
    # a single string is accepted too (MindIE)
    assert gen(client, "hello world", stop="wor").json()["generated_text"] == "hello wor"


def test_decoder_input_details_returns_prefill(client):
    d = gen(client, "hey", decoder_input_details=True).json()["details"]
    assert [p["id"] for p in d["prefill"]] == [104, 101, 121]
    assert [p["text"] for p in d["prefill"]] == ["h", "e", "y"]
    assert d["prefill"][0]["logprob"] is None
    assert all(isinstance(p["logprob"], float) for p in d["prefill"][1:])
    assert all(set(p) == {"id", "text", "logprob"} for p in d["prefill"])


def test_top_n_tokens(client):
    d = gen(client, "hey", details=True, top_n_tokens=2).json()["details"]
    assert len(d["top_tokens"]) == len(d["tokens"]) == 4
    assert all(isinstance(step, list) and step and set(step[0]) == {"id", "text", "logprob", "special"}
               for step in d["top_tokens"])
    assert d["top_tokens"][0][0]["id"] == 104


def test_best_of_returns_best_of_sequences(client):
    d = gen(client, "hey", best_of=2, do_sample=True, details=True).json()
    assert d["generated_text"] == "hey"
    details = d["details"]
    assert isinstance(details["seed"], int)
    others = details["best_of_sequences"]
    assert len(others) == 1
    assert set(others[0]) >= {"generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert others[0]["generated_text"] == "hey" and isinstance(others[0]["seed"], int)
    assert others[0]["seed"] != details["seed"]


def test_sampling_reports_a_seed_and_greedy_does_not(client):
    assert gen(client, "a", details=True, do_sample=True).json()["details"]["seed"] >= 0
    assert gen(client, "a", details=True, temperature=0.5).json()["details"]["seed"] >= 0
    assert gen(client, "a", details=True, seed=42, do_sample=True).json()["details"]["seed"] == 42
    assert gen(client, "a", details=True).json()["details"]["seed"] is None


def test_truncate_keeps_the_last_input_tokens(client):
    d = gen(client, "abcdef", truncate=3, details=True, decoder_input_details=True).json()
    assert d["generated_text"] == "def"
    assert [p["text"] for p in d["details"]["prefill"]] == ["d", "e", "f"]


def test_explicit_nulls_and_unknown_keys_are_accepted(client):
    params = {k: None for k in TEXT_GENERATION_PARAMS}
    r = client.post("/generate", json={"inputs": "ok", "parameters": params, "stream": None, "extra": 1})
    assert r.status_code == 200 and r.json() == {"generated_text": "ok"}
    r = client.post("/generate", json={"inputs": "ok", "parameters": None})
    assert r.status_code == 200
    r = client.post("/generate", json={"inputs": "ok", "parameters": {"adapter_id": "None", "watermark": False}})
    assert r.status_code == 200


# -- streams -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path,extra", [("/generate_stream", {}), ("/", {"stream": True})])
def test_stream_framing(client, path, extra):
    r = client.post(path, json={"inputs": "hey", "parameters": {"details": True, "max_new_tokens": 10}, **extra})
    assert r.status_code == 200
    assert r.headers["x-accel-buffering"] == "no"
    events = sse_events(r)
    assert [e["index"] for e in events] == [1, 2, 3, 4]
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
        assert "top_tokens" not in e
    last = events[-1]
    assert last["generated_text"] == "hey"
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": 4, "seed": None, "input_length": 3}
    assert last["token"]["special"] is True
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == "hey"


def test_stream_without_details_and_with_top_tokens(client):
    events = sse_events(client.post("/generate_stream", json={
        "inputs": "ab", "parameters": {"top_n_tokens": 1, "return_full_text": True}}))
    assert events[-1]["details"] is None and events[-1]["generated_text"] == "abab"
    assert all(len(e["top_tokens"]) == 1 for e in events)


def test_stream_stop_sequence(client):
    events = sse_events(client.post("/generate_stream", json={
        "inputs": "hello", "parameters": {"stop": ["ll"], "details": True}}))
    assert events[-1]["generated_text"] == "hell"
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"


def test_stream_error_after_start_is_an_event(echo_app, monkeypatch):
    client, context = echo_app()
    break_after_first_event(monkeypatch, context.engine, "the backend broke")
    events = sse_events(client.post("/generate_stream", json={"inputs": "hello"}))
    assert "token" in events[0]
    assert events[-1] == {"error": "Request failed during generation: the backend broke", "error_type": "generation"}


# -- validation: TGI's rules and words ---------------------------------------------------------
@pytest.mark.parametrize("params,message", [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1.0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": -1}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": -5}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"stop": [""]}, "`stop` sequences must not be empty strings"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"top_n_tokens": -1}, "`top_n_tokens` must be >= 0 and <= 5. Given: -1"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 511. Given: 0"),
    ({"truncate": 600}, "`truncate` must be strictly positive and less than 511. Given: 600"),
    ({"max_new_tokens": 510}, "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 5 `inputs` tokens and "
                              "510 `max_new_tokens`"),
    ({"watermark": True}, "`watermark` is not supported by this server (send false or null)"),
    ({"adapter_id": "my-lora"}, "`adapter_id` 'my-lora' is not available: this server does not serve LoRA adapters "
                                "(send null)"),
    ({"grammar": {"type": "ebnf", "value": "x"}}, "grammar is not valid: unknown grammar type 'ebnf'; expected json, "
                                                  "json_object, json_schema or regex"),
    ({"grammar": {"type": "json", "value": "{not json"}}, "grammar is not valid: "),
    ({"grammar": {"type": "json", "value": 5}}, "grammar is not valid: `value` must be a JSON schema object"),
    ({"grammar": {"type": "json_schema", "value": {"name": "x"}}}, "grammar is not valid: `value` must be"),
    ({"grammar": {"type": "regex", "value": ""}}, "grammar is not valid: `value` must be a non-empty regular"),
    ({"grammar": {"type": "regex", "value": "[a-"}}, "grammar is not valid: invalid regular expression"),
    ({"grammar": {"type": "json", "value": {"type": "nope"}}}, "grammar is not valid: invalid JSON schema"),
    ({"temperature": "hot"}, "parameters.temperature: Input should be a valid number"),
    ({"details": "maybe"}, "parameters.details: Input should be a valid boolean"),
    ({"seed": -1}, "parameters.seed: Input should be greater than or equal to 0"),
])
@pytest.mark.parametrize("path", ["/", "/generate", "/generate_stream"])
def test_validation_errors(client, path, params, message):
    if path == "/generate_stream" and params.get("best_of") == 2:
        message = "`best_of` != 1 is not supported when streaming tokens"  # checked first on streams
    r = gen(client, "hello", path=path, **params)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error", "error_type"}
    assert body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: " + message), body["error"]


@pytest.mark.parametrize("body,message", [
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": "x" * 600}, "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 600 `inputs` tokens and 20"),
    ({"inputs": [{"type": "text", "text": "hi"}]}, "`inputs` must be a string: multimodal inputs are not supported"),
    ({"inputs": 5}, "inputs: Input should be a valid string"),
    ({"parameters": {}}, "inputs: field required"),
    ({"inputs": "x", "parameters": [1]}, "parameters: Input should be a valid dictionary"),
])
@pytest.mark.parametrize("path", ["/", "/generate_stream"])
def test_body_errors(client, path, body, message):
    r = client.post(path, json=body)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert r.json()["error"].startswith("Input validation error: " + message), r.json()


def test_shared_generate_body_errors(client):
    r = client.post("/generate", json={"inputs": ""})
    assert r.status_code == 422 and r.json() == {"error": "Input validation error: `inputs` cannot be empty",
                                                 "error_type": "validation"}
    r = client.post("/generate", json={"inputs": 5})
    assert r.status_code == 422 and r.json()["error"].startswith("Input validation error: inputs:")


def test_stream_only_rules(client):
    r = gen(client, path="/generate_stream", decoder_input_details=True)
    assert r.status_code == 422
    assert r.json()["error"] == ("Input validation error: `decoder_input_details` == true is not supported when "
                                 "streaming tokens")
    r = gen(client, path="/generate_stream", best_of=2, do_sample=True)
    assert r.json()["error"] == "Input validation error: `best_of` != 1 is not supported when streaming tokens"
    r = client.post("/", json={"inputs": "x", "stream": True, "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


@pytest.mark.parametrize("content", [b"{x", b"[1, 2]", b'"text"', b"null"])
def test_malformed_bodies_are_422_not_500(client, content):
    for path in ("/", "/generate_stream"):
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.text)
        assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
    # shared routes: a body no dialect recognises is answered in the first sharing dialect's format
    for path in ("/generate", "/tokenize"):
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code in (400, 422) and "error" in r.json(), (path, r.text)


def test_input_length_rule():
    from llmserve.plugins.protocols.tgi.params import validate
    from llmserve.plugins.protocols.tgi.wire import TGIGenerateRequest, TGIOptions

    class Engine:
        max_model_len = 100

        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

    opts = TGIOptions(max_input_tokens=10)
    with pytest.raises(InvalidRequestError, match=r"^`inputs` must have less than 10 tokens. Given: 12$"):
        validate(TGIGenerateRequest(inputs="x" * 12, parameters={"max_new_tokens": 5}), opts, Engine(), stream=False)
    plan = validate(TGIGenerateRequest(inputs="x" * 12, parameters={"max_new_tokens": 5, "truncate": 10}),
                    opts, Engine(), stream=False)
    assert plan.input_length == 10
    # current TGI's default when max_new_tokens is absent and the option is null
    plan = validate(TGIGenerateRequest(inputs="x" * 12), TGIOptions(default_max_new_tokens=None), Engine(),
                    stream=False)
    assert plan.sampling.max_tokens == 88
    with pytest.raises(InvalidRequestError, match="is not allowed for this endpoint"):
        validate(TGIGenerateRequest(inputs="x", parameters={"best_of": 2, "do_sample": True}),
                 TGIOptions(max_best_of=1), Engine(), stream=False)


def test_grammar_forms_map_to_guided_specs():
    from llmserve.plugins.protocols.tgi.params import _grammar_spec
    from llmserve.plugins.protocols.tgi.wire import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _grammar_spec(Grammar(type="json", value=schema)).kind == "json_schema"
    assert _grammar_spec(Grammar(type="json", value=json.dumps(schema))).value == schema
    assert _grammar_spec(Grammar(type="json_object", value=schema)).value == schema
    assert _grammar_spec(Grammar(type="json_object", value={})).kind == "json_object"
    spec = _grammar_spec(Grammar(type="json_schema", value={"name": "x", "schema": schema}))
    assert (spec.kind, spec.value) == ("json_schema", schema)
    assert _grammar_spec(Grammar(type="regex", value="[0-9]+")).kind == "regex"


def test_valid_grammar_is_accepted(client):
    r = gen(client, "12", grammar={"type": "regex", "value": "[0-9]+"})
    assert r.status_code == 200
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = gen(client, "{}", grammar={"type": "json", "value": schema})
    assert r.status_code == 200


def test_kernel_errors_in_tgi_words():
    from llmserve.plugins.protocols.tgi.protocol import error_body

    assert error_body(OverloadedError("queue full")) == (429, {"error": "Model is overloaded: queue full",
                                                               "error_type": "overloaded"})
    assert error_body(GenerationError("boom")) == (424, {"error": "Request failed during generation: boom",
                                                         "error_type": "generation"})
    status, body = error_body(EngineDeadError("dead"))
    assert status == 503 and body["error_type"] == "generation"
    assert error_body(InvalidRequestError("bad"))[0] == 422


# -- /tokenize, /info, OpenAPI -----------------------------------------------------------------
def test_tokenize(client):
    r = client.post("/tokenize", json={"inputs": "hey", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    assert r.json() == [{"id": 104, "text": "h", "start": 0, "stop": 1},
                        {"id": 101, "text": "e", "start": 1, "stop": 2},
                        {"id": 121, "text": "y", "start": 2, "stop": 3}]
    r = client.post("/tokenize", json={"inputs": ""})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_info(client):
    info = client.get("/info").json()
    assert info["model_id"] == "echo" and info["router"] == "text-generation-router"
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["max_best_of"] == 2 and info["max_stop_sequences"] == 4
    for key in ("model_sha", "model_pipeline_tag", "max_concurrent_requests", "validation_workers",
                "max_client_batch_size", "version", "sha", "docker_label"):
        assert key in info


def test_openapi_declares_every_route_with_a_body(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/", "/generate", "/generate_stream", "/tokenize"):
        op = paths[path]["post"]
        assert "requestBody" in op, path
    assert "get" in paths["/info"]
    schemas = spec["components"]["schemas"]
    assert "TGIGenerateRequest" in schemas and "TGICompatRequest" in schemas
    assert "VLLMGenerateRequest" in schemas
    refs = json.dumps(paths["/generate"]["post"]["requestBody"])
    assert "TGIGenerateRequest" in refs and "VLLMGenerateRequest" in refs


def test_only_tgi_served(echo_app):
    client, _ = echo_app(protocols=["tgi"])
    assert client.post("/generate", json={"inputs": "ok"}).json() == {"generated_text": "ok"}
    r = client.post("/generate", json={"prompt": "ok"})
    assert r.status_code == 422 and "a TGI body with `inputs`" in r.json()["error"]


def test_no_nan_in_logprobs():
    from llmserve.plugins.protocols.tgi.tokens import finite, finish_reason

    assert finite(float("nan")) is None and finite(-math.inf) is None and finite(-1.5) == -1.5
    assert finish_reason("stop", "###") == "stop_sequence"
    assert finish_reason("stop", None) == "eos_token"
    assert finish_reason("length", None) == "length"
