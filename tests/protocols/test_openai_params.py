"""Every invalid value named in docs/openai.md's parameter tables is a 400 in the OpenAI
envelope whose ``param`` names the field (echo backend: fast, no model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "chat_template": TEMPLATE, "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
BOTH = ("/v1/completions", "/v1/chat/completions")

# (extra fields, expected param) for fields shared by chat and completions.
SHARED = [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "two"}, "n"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "n": 2, "stream": True}, "best_of"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"typical_p": 0}, "typical_p"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"priority": "high"}, "priority"),
    ({"stream_options": {"include_usage": "x"}, "stream": True}, "stream_options.include_usage"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
]

COMPLETION_ONLY = [
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x" * 600}, "prompt"),
    ({"echo": True, "max_tokens": 0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
]

CHAT_ONLY = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.image_url"),
    ({"logprobs": "x"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "chat_template"),
    ({"chat_template": "{{ messages[0].content.nope() }}"}, "chat_template"),
    ({"tools": "x"}, "tools"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids.0"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),  # not "no ids": the messages would be rendered instead
    ({"documents": "x"}, "documents"),
]


@pytest.fixture(scope="module")
def client():
    """One trusted echo server for the module (chat needs a request template on echo), strict
    about model names (test_unknown_model_is_404)."""
    from fastapi.testclient import TestClient

    from conftest import ECHO_PLUGIN
    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN], "trust_request_chat_template": True,
                             "strict_model_name": True}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def body_for(route: str, extra: dict) -> dict:
    body = {**(CHAT if "chat" in route else COMPLETION), **extra}
    return {k: v for k, v in body.items() if v is not None}


def assert_error(response, param: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    # The status as the code, as vLLM sends it; a prompt over the context carries OpenAI's name for it.
    context = "maximum context length" in error["message"]
    assert error["code"] == ("context_length_exceeded" if context else status), error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert response.headers["x-should-retry"] == "false"
    return error


@pytest.mark.parametrize("route", BOTH)
@pytest.mark.parametrize("extra, param", SHARED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(SHARED)])
def test_shared_field_400(client, route, extra, param):
    assert_error(client.post(route, json=body_for(route, extra)), param)


@pytest.mark.parametrize("extra, param", COMPLETION_ONLY, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_ONLY)])
def test_completion_field_400(client, extra, param):
    assert_error(client.post("/v1/completions", json=body_for("/v1/completions", extra)), param)


@pytest.mark.parametrize("extra, param", CHAT_ONLY, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_ONLY)])
def test_chat_field_400(client, extra, param):
    assert_error(client.post("/v1/chat/completions", json=body_for("/v1/chat/completions", extra)), param)


@pytest.mark.parametrize("route", BOTH)
def test_unknown_model_is_404(client, route):
    assert_error(client.post(route, json=body_for(route, {"model": "nope"})), "model", status=404)


def test_request_chat_template_needs_the_flag(echo_app):
    untrusted, _ = echo_app()
    assert_error(untrusted.post("/v1/chat/completions", json=CHAT), "chat_template")


def test_unknown_fields_and_nulls_are_accepted(client):
    extra = {"functions": [{"name": "f"}], "store": True, "service_tier": "auto", "user": "me",
             "metadata": {"k": "v"}, "temperature": None, "stream_options": None}
    for route in BOTH:
        r = client.post(route, json=body_for(route, extra))
        assert r.status_code == 200, r.text


def test_every_wire_field_is_in_the_parameter_tables():
    from llmserve.plugins.protocols.openai.wire import ChatCompletionRequest, CompletionRequest, StreamOptions

    text = DOC.read_text()
    tables = text[text.index("## Parameters"):text.index("## Errors")]
    documented = set(re.findall(r"`([a-z_]+)", tables)) | set(re.findall(r"`stream_options\.([a-z_]+)`", tables))
    fields = (set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
              | set(StreamOptions.model_fields))
    assert not fields - documented, f"docs/openai.md does not document {sorted(fields - documented)}"
