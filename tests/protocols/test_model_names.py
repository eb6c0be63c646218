"""Model names, on the echo backend (fast) and the embedded MiniLM: with one served name any
``model`` is accepted and answered under that name (as TGI and llama.cpp do); with
``--strict-model-name``, or with several served names, an unknown one is a 404 in each dialect's
own error format. Every dialect resolves names through ``ServerContext.check_model``.

MindIE's native routes (``/infer``, ``/v1/tokenizer``) and TGI's (``/generate``, ``/info``, ...)
carry no model name; MindIE's model-named routes are the Triton ones below and TGI clients chat
through the OpenAI route (the real clients are in ``test_model_names_clients.py``)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from llmserve.config import load_config

SERVED = "echo"  # the echo backend's model name
UNKNOWN = "tgi"  # what text_generation.Client.chat and litellm's huggingface/ provider send
# the echo model has no chat template: requests send one (the apps trust them)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": "{{ messages[0].content }}"}
TEXT = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}


def first_event(text: str) -> dict:
    """The first ``data:`` event of an SSE body."""
    return json.loads(text.split("\n\n")[0].removeprefix("data: "))


# (dialect, method, path for model m, body for model m, the name the 200 answers under or None)
ROUTES = [
    ("openai", "POST", lambda m: "/v1/completions", lambda m: {"prompt": "hi", "max_tokens": 2, "model": m},
     lambda r: r.json()["model"]),
    ("openai", "POST", lambda m: "/v1/chat/completions", lambda m: {**CHAT, "model": m},
     lambda r: r.json()["model"]),
    ("openai", "POST", lambda m: "/v1/chat/completions", lambda m: {**CHAT, "model": m, "stream": True},
     lambda r: first_event(r.text)["model"]),
    ("openai", "GET", lambda m: f"/v1/models/{m}", lambda m: None, lambda r: r.json()["id"]),
    ("openai", "POST", lambda m: "/tokenize", lambda m: {"prompt": "hi", "model": m}, None),
    ("openai", "POST", lambda m: "/detokenize", lambda m: {"tokens": [104], "model": m}, None),
    ("vllm_native", "POST", lambda m: "/generate", lambda m: {"prompt": "hi", "max_tokens": 2, "model": m}, None),
    ("triton", "GET", lambda m: f"/v2/models/{m}", lambda m: None, lambda r: r.json()["name"]),
    ("triton", "GET", lambda m: f"/v2/models/{m}/versions/1", lambda m: None, lambda r: r.json()["name"]),
    ("triton", "GET", lambda m: f"/v2/models/{m}/ready", lambda m: None, lambda r: r.json()["name"]),
    ("triton", "GET", lambda m: f"/v2/models/{m}/config", lambda m: None, lambda r: r.json()["name"]),
    ("triton", "GET", lambda m: f"/v2/models/{m}/stats", lambda m: None,
     lambda r: r.json()["model_stats"][0]["name"]),
    ("triton", "POST", lambda m: f"/v2/models/{m}/generate", lambda m: {"text_input": "hi"},
     lambda r: r.json()["model_name"]),
    ("triton", "POST", lambda m: f"/v2/models/{m}/generate_stream", lambda m: {"text_input": "hi"},
     lambda r: first_event(r.text)["model_name"]),
    ("triton", "POST", lambda m: f"/v2/models/{m}/infer", lambda m: TEXT, lambda r: r.json()["model_name"]),
]
IDS = [f"{d}-{m}-{p('m')}" + ("-stream" if (b("m") or {}).get("stream") else "") for d, m, p, b, _ in ROUTES]


@pytest.fixture
def app(echo_app):
    return lambda **flags: echo_app(trust_request_chat_template=True, **flags)[0]


def call(client, route, model: str):
    _, method, path, body, _ = route
    return client.request(method, path(model), json=body(model))


def assert_not_found(dialect: str, response, model: str) -> None:
    """A 404 in the dialect's own error format, naming the model."""
    assert response.status_code == 404, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    if dialect == "triton":  # KServe: {"error": "..."}
        assert body == {"error": f"Request for unknown model: '{model}' is not found"}
    else:  # OpenAI's envelope (vLLM-native uses it too)
        assert body["error"] == {"message": f"The model `{model}` does not exist.", "type": "not_found_error",
                                 "param": "model", "code": 404}


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_one_served_name_accepts_any_name_and_answers_under_it(app, route):
    client = app()
    for name in (UNKNOWN, "dummy", SERVED):
        r = call(client, route, name)
        assert r.status_code == 200, r.text
        if route[4] is not None:
            assert route[4](r) == SERVED


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_strict_model_name_is_a_404_in_the_dialect_format(app, route):
    client = app(strict_model_name=True)
    assert_not_found(route[0], call(client, route, UNKNOWN), UNKNOWN)
    assert call(client, route, SERVED).status_code == 200


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_several_served_names_refuse_unknown_ones(app, route):
    client = app(served_model_name=["a", "b"])
    assert_not_found(route[0], call(client, route, UNKNOWN), UNKNOWN)
    r = call(client, route, "b")  # an alias: OpenAI answers under the first name, Triton echoes it
    assert r.status_code == 200, r.text
    if route[4] is not None:
        assert route[4](r) == ("b" if route[0] == "triton" else "a")


def test_strict_keeps_empty_names_and_the_model_path_and_versions_stay_exact(app):
    client = app(strict_model_name=True)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["model"] == SERVED
    assert client.post("/generate", json={"prompt": "hi", "max_tokens": 1, "model": None}).status_code == 200
    assert client.get("/v2/models/echo://").json()["name"] == "echo://"
    for strict in (True, False):  # any name, but not any version: the only one is 1
        r = app(strict_model_name=strict).get(f"/v2/models/{UNKNOWN}/versions/2/ready")
        what = f"'{UNKNOWN}'" if strict else f"'{UNKNOWN}' version 2"
        assert r.status_code == 404 and r.json() == {"error": f"Request for unknown model: {what} is not found"}


def test_the_flag_comes_from_cli_yaml_and_env(tmp_path):
    assert load_config({}, environ={})[0].strict_model_name is False
    assert load_config({}, environ={"LLMSERVE_STRICT_MODEL_NAME": "true"})[0].strict_model_name is True
    yaml = tmp_path / "c.yaml"
    yaml.write_text("strict_model_name: true\n")
    assert load_config({}, str(yaml), environ={})[0].strict_model_name is True
    shown = run_cli("config", "show", "--strict-model-name").stdout.splitlines()
    assert [line.split() for line in shown if line.startswith("strict-model-name")] == [
        ["strict-model-name", "true", "cli"]]


# -- the pooling routes, on the embedded MiniLM ------------------------------------------------
POOLING = [
    ("/v1/embeddings", {"input": "hello"}, lambda r: r.json()["model"]),
    ("/score", {"text_1": "a", "text_2": "b"}, lambda r: r.json()["model"]),
    ("/rerank", {"query": "q", "documents": ["a", "b"]}, lambda r: r.json()["model"]),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, lambda r: r.json()["model"]),
]


@pytest.fixture(scope="module")
def embed():
    from fastapi.testclient import TestClient

    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    config, _ = load_config({"task": "embed", "protocols": ["openai", "ops"], "served_model_name": ["mini"]},
                            environ={})
    app, context = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, context


@pytest.mark.parametrize("path,body,answered", POOLING, ids=[p for p, _, _ in POOLING])
def test_pooling_routes_follow_the_same_rule(embed, path, body, answered):
    client, context = embed
    r = client.post(path, json={**body, "model": UNKNOWN})
    assert r.status_code == 200 and answered(r) == "mini", r.text
    context.config.llm.strict_model_name = True  # one model load for both halves; read per request
    try:
        assert_not_found("openai", client.post(path, json={**body, "model": UNKNOWN}), UNKNOWN)
        assert answered(client.post(path, json={**body, "model": "mini"})) == "mini"
    finally:
        context.config.llm.strict_model_name = False
