"""A ``max_tokens`` larger than the room the prompt leaves: OpenAI's chat, completions and Responses
cut it to the room by default, as OpenAI's own API, Anthropic and Ollama do (agent clients that send
32000 must not be refused on a small context); ``--strict-max-tokens`` keeps vLLM's 400. vLLM's own
``/generate`` and TGI keep refusing it, as their servers do."""

from __future__ import annotations

import pytest

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
ROOM_PROMPT = "hello"
ROUTES = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": ROOM_PROMPT}], "max_tokens": 100_000},
                             "max_tokens"),
    "/v1/completions": ({"prompt": ROOM_PROMPT, "max_tokens": 100_000}, "max_tokens"),
    "/v1/responses": ({"input": ROOM_PROMPT, "max_output_tokens": 100_000}, "max_output_tokens"),
}


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_max_tokens_over_the_room_is_cut_to_it_by_default(echo_app, path):
    client, context = echo_app(chat_template=TEMPLATE, max_model_len=64)
    body, _ = ROUTES[path]
    reply = client.post(path, json={"model": "echo", **body})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    out = usage.get("completion_tokens", usage.get("output_tokens"))
    assert 0 < out <= 64 - usage.get("prompt_tokens", usage.get("input_tokens"))


@pytest.mark.parametrize("path", list(ROUTES))
def test_strict_max_tokens_refuses_it_naming_the_field(echo_app, path):
    client, _ = echo_app(chat_template=TEMPLATE, max_model_len=64, strict_max_tokens=True)
    body, field = ROUTES[path]
    reply = client.post(path, json={"model": "echo", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"'{field}' is too large: 100000.")


def test_vllms_own_generate_route_still_refuses_it(echo_app):
    client, _ = echo_app(max_model_len=64)
    reply = client.post("/generate", json={"prompt": ROOM_PROMPT, "max_tokens": 100_000})
    assert reply.status_code == 400 and "'max_tokens' is too large" in reply.text, reply.text


def test_max_completion_tokens_is_named_when_strict(echo_app):
    client, _ = echo_app(chat_template=TEMPLATE, max_model_len=64, strict_max_tokens=True)
    reply = client.post("/v1/chat/completions", json={"model": "echo", "max_completion_tokens": 100_000,
                                                      "messages": [{"role": "user", "content": ROOM_PROMPT}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_completion_tokens", reply.text
