"""A request's ``model`` is a name to compare and echo, never a path: ``../../etc/passwd`` is answered
under the served name (as any name is while one is served, the documented behaviour) and reaches
no file-system call; an absurd one (over 1024 characters, control characters) is a 400 in each
dialect's own error format."""

from __future__ import annotations

import builtins
import os

import pytest

PROBE = "../../llmserve-probe/etc/passwd"
ROUTES = [
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages", lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/api/generate", lambda m: {"model": m, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}),
    ("/v1/responses", lambda m: {"model": m, "input": "hi", "max_output_tokens": 16}),
]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def client(echo_app):
    client, _ = echo_app(chat_template=TEMPLATE)
    return client


@pytest.mark.parametrize("path, body", ROUTES, ids=[r[0] for r in ROUTES])
def test_a_path_shaped_name_is_answered_and_never_touches_the_file_system(client, monkeypatch, path, body):
    touched: list[str] = []

    def spy(real):
        def call(target, *args, **kwargs):
            if "llmserve-probe" in str(target):
                touched.append(str(target))
            return real(target, *args, **kwargs)
        return call

    for module, name in ((builtins, "open"), (os, "open"), (os, "stat"), (os, "lstat"), (os, "listdir"),
                         (os, "scandir"), (os.path, "exists")):
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    reply = client.post(path, json=body(PROBE))
    assert reply.status_code == 200, reply.text
    assert touched == []
    if path != "/api/generate":  # Ollama echoes the name the client sent, as Ollama does
        assert PROBE not in reply.text


@pytest.mark.parametrize("name", ["m" * 1_000_000, "bad\nname", "nul\x00"])
@pytest.mark.parametrize("path, body", ROUTES, ids=[r[0] for r in ROUTES])
def test_an_absurd_name_is_a_400_in_the_dialects_format(client, path, body, name):
    reply = client.post(path, json=body(name))
    assert reply.status_code == 400, reply.text
    assert "must be a model name of at most 1024 characters without control characters" in reply.text
    assert len(reply.text) < 2000  # the name is not echoed back
    error = reply.json()
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    elif path == "/api/generate":
        assert set(error) == {"error"}
    else:
        assert error["error"]["param"] == "model"
