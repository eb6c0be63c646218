"""vLLM-native ``POST /generate`` on the echo backend (fast): shapes, `\\0` stream records,
validation in the OpenAI envelope. The echo backend generates the prompt back, then EOS."""

import json

import pytest

from .wire_checks import break_after_first_event


@pytest.fixture
def client(echo_app):
    c, _ = echo_app()
    return c


def records(response):
    """Split a `\\0`-delimited stream the way vLLM's api_client does (iter_lines(delimiter=b"\\0"))."""
    assert not response.headers["content-type"].startswith("text/event-stream")
    raw = response.content
    assert raw.endswith(b"\0") and b"data:" not in raw and b"[DONE]" not in raw
    return [json.loads(chunk) for chunk in raw.split(b"\0") if chunk]


def test_non_stream_is_prompt_plus_text_per_sequence(client):
    r = client.post("/generate", json={"prompt": "hey", "max_tokens": 10})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"text": ["heyhey"]}
    r = client.post("/generate", json={"prompt": "ab", "n": 3, "temperature": 0.8, "seed": 1})
    assert r.json() == {"text": ["abab"] * 3}


def test_max_tokens_default_is_16(client):
    r = client.post("/generate", json={"prompt": "x" * 40})
    assert r.json()["text"][0] == "x" * 56


def test_stream_records_are_cumulative_and_nul_terminated(client):
    r = client.post("/generate", json={"prompt": "hey", "stream": True, "max_tokens": 10})
    assert r.status_code == 200
    assert r.headers["x-accel-buffering"] == "no"
    recs = records(r)
    assert [rec["text"] for rec in recs[:3]] == [["heyh"], ["heyhe"], ["heyhey"]]
    assert recs[-1] == {"text": ["heyhey"]}
    for a, b in zip(recs, recs[1:]):
        assert b["text"][0].startswith(a["text"][0])


def test_stream_with_n(client):
    recs = records(client.post("/generate", json={"prompt": "ab", "stream": True, "n": 2, "temperature": 1.0}))
    assert all(len(rec["text"]) == 2 for rec in recs)
    assert recs[-1] == {"text": ["abab", "abab"]}


def test_spec_example_body(client):
    """The spec's request example (MindIE vLLM /generate), field for field."""
    body = {"prompt": "My name is Olivier and I", "max_tokens": 20, "repetition_penalty": 1.03,
            "presence_penalty": 1.2, "frequency_penalty": 1.2, "temperature": 0.5, "top_p": 0.95, "top_k": 10,
            "seed": None, "stream": False, "stop": None, "stop_token_ids": None, "model": "None",
            "include_stop_str_in_output": False, "skip_special_tokens": True, "ignore_eos": False}
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    assert set(r.json()) == {"text"}
    assert r.json()["text"][0].startswith("My name is Olivier and I")


def test_stop_strings_and_include_stop_str(client):
    assert client.post("/generate", json={"prompt": "hello", "stop": "ll"}).json() == {"text": ["hellohe"]}
    r = client.post("/generate", json={"prompt": "hello", "stop": ["ll"], "include_stop_str_in_output": True})
    assert r.json() == {"text": ["hellohell"]}
    r = client.post("/generate", json={"prompt": "hello", "stop_token_ids": [108]})
    assert r.json() == {"text": ["hellohe"]}
    r = client.post("/generate", json={"prompt": "hello", "stop_token_ids": [2**40]})  # outside int32: ignored
    assert r.json() == {"text": ["hellohello"]}


def test_ignore_eos_and_special_tokens(client):
    r = client.post("/generate", json={"prompt": "ab", "ignore_eos": True, "max_tokens": 4,
                                       "skip_special_tokens": False})
    assert r.status_code == 200
    assert r.json()["text"][0].startswith("abab")


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "x", "temperature": -0.5}, "temperature", "temperature must be non-negative, got -0.5."),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5."),
    ({"prompt": "x", "top_k": 0}, "top_k", "top_k must be -1 (disable), or at least 1, got 0."),
    ({"prompt": "x", "top_k": -2}, "top_k", "top_k must be -1 (disable), or at least 1, got -2."),
    ({"prompt": "x", "min_p": 2}, "min_p", "min_p must be in [0, 1], got 2.0."),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 2], got 0.0."),
    ({"prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty",
     "repetition_penalty must be in (0, 2], got 2.5."),
    ({"prompt": "x", "presence_penalty": 2.1}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.1."),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3.0."),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0, got -1."),
    ({"prompt": "x", "min_tokens": 20}, "min_tokens",
     "min_tokens must be less than or equal to max_tokens=16, got 20."),
    ({"prompt": "x", "n": 0}, "n", "n must be at least 1, got 0."),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of must be greater than or equal to n, got n=2 and "
                                                      "best_of=1."),
    ({"prompt": "x", "seed": -1}, "seed", "seed must be in [0, 18446744073709551615], got -1."),
    ({"prompt": "x", "seed": 2**64}, "seed", "seed must be in [0, 18446744073709551615], got 18446744073709551616."),
    ({"prompt": "x", "stop": [""]}, "stop", "stop strings must be at least 1 character long."),
    ({"prompt": "x", "stop": ["a" * 20000, "b" * 20000]}, "stop", "the stop strings must be at most 32768 "
                                                                   "characters in all, got 40000."),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "use_beam_search is not supported"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids", "stop_token_ids: token id 99999 is out of "
                                                                   "vocabulary"),
    ({"prompt": ""}, "prompt", "prompt must be a non-empty string"),
    ({"prompt": [{"type": "text", "text": "hi"}]}, "prompt", "prompt: multimodal (list) prompts are not supported"),
    ({"prompt": "x", "multi_modal_data": {"video": "v"}}, "multi_modal_data.video", "multi_modal_data: video inputs "
                                                                                   "are not supported"),
    ({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
    ({"prompt": "x" * 600}, "prompt", "This model's maximum context length is 512 tokens. However, your request "
                                      "has 600 input tokens."),
    ({"prompt": "x" * 500, "max_tokens": 100}, "max_tokens", "'max_tokens' is too large: 100."),
    ({"prompt": "x", "temperature": "warm"}, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": "x", "stream": "maybe"}, "stream", "stream: Input should be a valid boolean"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_validation_errors_in_openai_envelope(client, body, param, message, stream):
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert err["message"].startswith(message), err["message"]


@pytest.mark.parametrize("raw,param,message", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 2}', "prompt",
     "request body is nested too deeply"),
    (b'{"max_tokens": 2, "prompt": "ab\\ud800cd"}', "prompt", "prompt: text contains a lone UTF-16 surrogate"),
    (b'{"prompt": "ab", "max_tokens": 2', None, "request body is not valid JSON"),
])
def test_bodies_breaking_the_json_rules_get_the_openai_envelope(client, raw, param, message):
    """/generate is shared with TGI: a vLLM body (`prompt`) that cannot be used as JSON is still
    refused in vLLM's envelope, not in TGI's 422 (the first dialect of the route)."""
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"].startswith(message), err
    r = client.post("/generate", content=raw.replace(b'"prompt"', b'"inputs"'),
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text  # TGI's body: TGI's error


def test_unknown_model_is_404(echo_app):
    client, _ = echo_app(strict_model_name=True)
    r = client.post("/generate", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.post("/generate", json={"prompt": "x", "model": "echo", "max_tokens": 1}).status_code == 200
    assert client.post("/generate", json={"prompt": "x", "model": None, "max_tokens": 1}).status_code == 200


def test_explicit_nulls_and_unknown_keys(client):
    body = {"prompt": "ok", "n": None, "best_of": None, "max_tokens": None, "min_tokens": None, "temperature": None,
            "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None, "presence_penalty": None,
            "frequency_penalty": None, "seed": None, "stop": None, "stop_token_ids": None, "bad_words": None,
            "include_stop_str_in_output": None, "skip_special_tokens": None, "ignore_eos": None, "model": None,
            "use_beam_search": False, "stream": None, "logprobs": None, "something_new": 1}
    r = client.post("/generate", json=body)
    assert r.status_code == 200 and r.json() == {"text": ["okok"]}


def test_stream_error_after_start_is_a_record(echo_app, monkeypatch):
    client, context = echo_app()
    break_after_first_event(monkeypatch, context.engine, "the backend broke")
    recs = records(client.post("/generate", json={"prompt": "hello", "stream": True}))
    assert recs[0] == {"text": ["helloh"]}
    assert recs[-1]["error"]["message"] == "the backend broke"


def test_only_vllm_native_served(echo_app):
    client, _ = echo_app(protocols=["vllm-native"])
    assert client.post("/generate", json={"prompt": "ok", "max_tokens": 2}).json() == {"text": ["okok"]}
    r = client.post("/generate", json={"inputs": "ok"})
    assert r.status_code == 400 and "a vLLM body with `prompt`" in r.json()["error"]["message"]
    spec = client.get("/openapi.json").json()
    assert "requestBody" in spec["paths"]["/generate"]["post"]
    assert "VLLMGenerateRequest" in json.dumps(spec["paths"]["/generate"]["post"]["requestBody"])
