"""``--chat-template``: the server's own template replaces the model's, for every dialect, and
a bad one stops the server at start with one line."""

from __future__ import annotations

import pytest

from conftest import run_cli
from llmserve.errors import ConfigError

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _echoed_prompt(client) -> str:
    # The echo backend "generates" its prompt back: the reply shows what the template rendered.
    reply = client.post("/v1/chat/completions", json={
        "model": "echo", "max_tokens": 200,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_a_template_file_replaces_the_models(echo_app, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    client, context = echo_app(chat_template=str(path))
    assert context.model.chat_template == TEMPLATE
    assert _echoed_prompt(client).startswith("<system>be brief|<user>hi|<assistant>")
    # The Ollama dialect renders with the same template.
    reply = client.post("/api/chat", json={"model": "echo", "stream": False, "options": {"num_predict": 200},
                                           "messages": [{"role": "user", "content": "yo"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["message"]["content"].startswith("<user>yo|<assistant>")


def test_template_text_is_taken_as_is(echo_app):
    client, _ = echo_app(chat_template=TEMPLATE)
    assert _echoed_prompt(client).startswith("<system>be brief|<user>hi|")


@pytest.mark.parametrize("value, words", [
    ("no/such/template.jinja", "neither a file nor a template"),
    ("{% for m in messages %}", "not a valid template"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused"),
])
def test_a_bad_template_stops_the_server_at_start(echo_app, value, words):
    with pytest.raises(ConfigError, match=words):
        echo_app(chat_template=value)


def test_the_cli_says_so_in_one_line():
    proc = run_cli("serve", "--backend", "echo", "--plugin", "tests/plugins/echo_backend.py",
                   "--chat-template", "missing.jinja", "--port", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--chat-template: 'missing.jinja' is neither a file nor a template" in proc.stderr
    assert "Traceback" not in proc.stderr
