"""Guided decoding through the OpenAI routes, on test backends (no real model).

``echo`` ignores masks: it checks the 400s and that a guided request reaches the engine.
``pick`` (tests/guided/pick_backend.py) draws random tokens among those the mask allows, so
its output shows the constraint was applied end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

HERE = Path(__file__).resolve().parent
PICK = str(HERE / "pick_backend.py")
TOY = str(HERE / "toy_decoder.py")
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "chat_template": TEMPLATE}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n", "tags"]}


@pytest.fixture
def echo(echo_app):
    client, context = echo_app(trust_request_chat_template=True)
    return client, context


@pytest.fixture
def pick(echo_app):
    client, _ = echo_app(backend="pick", plugins=[PICK], trust_request_chat_template=True)
    return client


def error_of(response, status=400):
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("route, extra, param, text", [
    ("/v1/completions", {"guided_json": {"type": "foo"}}, "guided_json", "invalid JSON schema"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not JSON"),
    ("/v1/completions", {"guided_json": [1, 2]}, "guided_json", "JSON schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}}}},
     "response_format", "invalid JSON schema"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "invalid regular expression"),
    ("/v1/chat/completions", {"guided_regex": "[z-a]"}, "guided_regex", "invalid regular expression"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one of"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "response_format", "only one of"),
    ("/v1/completions", {"guided_grammar": "root ::= 'a'"}, "guided_grammar",
     "grammar-guided decoding needs a guided-decoding plugin that supports grammars; "
     "installed: lm-format-enforcer (json_schema, json_object, regex, choice, structure)"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema is required"),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format",
     "json_schema.schema is required"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
])
def test_guided_400s(echo, route, extra, param, text):
    client, _ = echo
    body = {**(CHAT if "chat" in route else {"prompt": "hi"}), "max_tokens": 4, **extra}
    error = error_of(client.post(route, json=body))
    assert error["param"] == param and text in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_guided_request_reaches_the_engine_and_is_cached(echo):
    client, context = echo
    for _ in range(2):
        r = client.post("/v1/completions", json={"prompt": "yes", "max_tokens": 5, "guided_choice": ["yes", "no"]})
        assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    assert len(context.guided._cache) == 1
    assert context.guided.decoder("lm-format-enforcer").kinds >= {"json_schema", "regex", "choice"}


def test_completions_json_schema_end_to_end(pick):
    r = pick.post("/v1/completions", json={"prompt": "x", "max_tokens": 400, "n": 4, "seed": 3, "guided_json": SCHEMA})
    body = r.json()
    assert r.status_code == 200, body
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    assert len({c["text"] for c in body["choices"]}) > 1


def test_guided_json_as_string_and_chat_response_format(pick):
    r = pick.post("/v1/completions", json={"prompt": "x", "max_tokens": 400, "guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = pick.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400, "n": 2, "response_format": fmt})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    r = pick.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400, "seed": 1,
                                                "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_regex_and_choice_end_to_end_streaming(pick):
    r = pick.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "n": 3, "guided_regex": r"\d{3}-[a-c]{2}"})
    assert r.status_code == 200, r.text
    assert all(len(c["text"]) == 6 and c["text"][3] == "-" for c in r.json()["choices"])
    r = pick.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": True,
                                                "guided_choice": ["alpha", "beta", "gamma"]})
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text in ("alpha", "beta", "gamma")


def test_decoder_plugin_from_a_file(echo_app):
    """A third-party decoder (tests/guided/toy_decoder.py) contributed with register_guided_decoders."""
    client, context = echo_app(backend="pick", plugins=[PICK, TOY])
    assert context.registry.names("guided_decoder") == ["lm-format-enforcer", "toy-literal"]
    assert context.registry.get("guided_decoder", "toy-literal").plugin == "toy_decoder"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_grammar": "hello!"})
    assert r.json()["choices"][0]["text"] == "hello!"
    error = error_of(client.post("/v1/completions", json={"prompt": "x", "guided_grammar": "!no"}))
    assert error["param"] == "guided_grammar" and "may not start" in error["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_choice": ["only"]})
    assert r.json()["choices"][0]["text"] == "only"  # other kinds still go to lm-format-enforcer
    assert sys.modules["llmserve_plugin_toy_decoder"].BUILT == ["toy-literal"]  # built once, on first use


def test_preferred_backend_and_unknown_name(echo_app):
    from llmserve.errors import ConfigError

    client, context = echo_app(backend="pick", plugins=[PICK, TOY], guided_decoding_backend="toy-literal")
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_regex": "ab"})
    assert r.json()["choices"][0]["text"] == "ab"
    assert context.guided.decoder_name("grammar") == "toy-literal"
    assert context.guided.decoder_name("regex") == "lm-format-enforcer"
    with pytest.raises(ConfigError, match="unknown guided decoder 'nope'; available: lm-format-enforcer, toy-literal"):
        echo_app(backend="pick", plugins=[PICK, TOY], guided_decoding_backend="nope")


def test_decoders_are_not_imported_until_a_request_needs_them():
    code = (
        "import sys\nfrom llmserve.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['plugins']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "from llmserve.config import load_config\nfrom llmserve.hooks.manager import PluginManager\n"
        "from llmserve.server.serve import build_server\n"
        f"config, _ = load_config({{'backend': 'pick', 'plugins': [{PICK!r}]}}, environ={{}})\n"
        "app, context = build_server(config, PluginManager().load(autoload=False))\n"
        "context.engine.shutdown()\n"
        "print('LAZY', [m for m in ('lmformatenforcer', 'llmserve.plugins.guided.lmfe') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LAZY []" in out.stdout, out.stdout + out.stderr
    assert "guided_decoder: lm-format-enforcer" in out.stdout
