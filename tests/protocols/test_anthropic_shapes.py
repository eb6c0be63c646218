"""The Anthropic Messages dialect on the echo backend: the model "says" what the last message
says (a one-line chat template), so each test writes the model output it needs and checks the
exact reply: content blocks, the streamed event sequence against the non-streamed message,
stop reasons, history conversion, errors in Anthropic's format and statuses."""

from __future__ import annotations

import json

import pytest

from llmserve.errors import (
    EngineDeadError,
    GenerationError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnauthorizedError,
)
from llmserve.plugins.protocols.anthropic.protocol import error_body

SAYS_LAST = "{{ messages[-1]['content'] }}"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture
def make(echo_app):
    def start(**flags):
        client, context = echo_app(**flags)
        context.model.tokenizer.chat_template = SAYS_LAST  # the echo tokenizer has none
        return client, context
    return start


@pytest.fixture
def client(make):
    return make(enable_auto_tool_choice=True, tool_call_parser="hermes")[0]


@pytest.fixture
def thinker(make):
    return make(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")[0]


def post(client, said, stream=False, **extra):
    body = {"model": "any", "max_tokens": 200, "messages": [{"role": "user", "content": said}],
            "stream": stream, **extra}
    return client.post("/v1/messages", json=body)


def events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def fold(evs: list[tuple[str, dict]]) -> dict:
    """The message a client assembles from the events, checking their order on the way."""
    names = [n for n, _ in evs if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    msg = evs[0][1]["message"]
    assert msg["content"] == [] and msg["stop_reason"] is None
    open_index = None
    for name, data in evs[1:]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(msg["content"])
            msg["content"].append(dict(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = msg["content"][open_index], data["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                assert kind == "input_json_delta"
                block["_json"] = block.get("_json", "") + delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            block = msg["content"][open_index]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("_json", "{}"))
            open_index = None
        elif name == "message_delta":
            assert open_index is None
            msg.update(data["delta"])
            msg["usage"].update(data["usage"])
    return msg


def test_thinking_and_text_blocks_streamed_and_not(thinker):
    client = thinker
    said = "<think>Oslo is in Norway.</think>It is in Norway."
    r = post(client, said)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["id"].startswith("msg_") and (msg["type"], msg["role"], msg["model"]) == ("message", "assistant", "echo")
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][0]["thinking"] == "Oslo is in Norway." and msg["content"][0]["signature"]
    assert msg["content"][1] == {"type": "text", "text": "It is in Norway."}
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("end_turn", None)
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == len(said.encode())
    r = post(client, said, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    streamed = fold(evs)
    assert streamed["content"] == msg["content"]
    assert (streamed["stop_reason"], streamed["usage"]["output_tokens"]) == ("end_turn", msg["usage"]["output_tokens"])
    assert [d["delta"]["type"] for n, d in evs if n == "content_block_delta"].count("signature_delta") == 1


def test_thinking_display_omitted_keeps_the_signature_only(thinker):
    client = thinker
    msg = post(client, "<think>secret</think>ok", thinking={"type": "enabled", "budget_tokens": 100,
                                                            "display": "omitted"}).json()
    assert msg["content"][0]["type"] == "thinking" and msg["content"][0]["thinking"] == ""
    assert msg["content"][0]["signature"]
    streamed = fold(events(post(client, "<think>secret</think>ok", stream=True,
                                thinking={"type": "enabled", "budget_tokens": 100, "display": "omitted"}).text))
    assert streamed["content"] == msg["content"]


def test_stop_sequences(client):
    for stream in (False, True):
        r = post(client, "one two STOP three", stream=stream, stop_sequences=["STOP", "never"])
        msg = fold(events(r.text)) if stream else r.json()
        assert msg["content"] == [{"type": "text", "text": "one two "}]
        assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")


def test_max_tokens_stop_reason(client):
    msg = post(client, "abcdefghij", max_tokens=4).json()
    assert msg["content"] == [{"type": "text", "text": "abcd"}]
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == ("max_tokens", 4)


def test_auto_tool_use_blocks(client):
    said = "Let me check. " + CALL
    msg = post(client, said, tools=TOOLS).json()
    assert msg["stop_reason"] == "tool_use"
    text, call = msg["content"]
    assert text == {"type": "text", "text": "Let me check."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["name"] == "get_weather"
    assert call["input"] == {"city": "Oslo"}
    streamed = fold(events(post(client, said, stream=True, tools=TOOLS).text))
    assert streamed["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in streamed["content"]] == \
        [("text", None, None), ("tool_use", "get_weather", {"city": "Oslo"})]


def test_disable_parallel_tool_use_keeps_the_first_call(client):
    two = CALL + CALL.replace("Oslo", "Rome")
    msg = post(client, two, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True}).json()
    assert [b["input"] for b in msg["content"] if b["type"] == "tool_use"] == [{"city": "Oslo"}]
    msg = post(client, two, tools=TOOLS).json()
    assert [b["input"] for b in msg["content"] if b["type"] == "tool_use"] == [{"city": "Oslo"}, {"city": "Rome"}]


def test_tool_choice_none_neither_offers_nor_parses(client):
    msg = post(client, CALL, tools=TOOLS, tool_choice={"type": "none"}).json()
    assert msg["content"] == [{"type": "text", "text": CALL}] and msg["stop_reason"] == "end_turn"


def test_tool_result_reaches_the_template_as_a_tool_message(client):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "I should call the tool.", "signature": "abc"},
                   {"type": "redacted_thinking", "data": "opaque"},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]}]
    for content in ("Sunny, 21 C", [{"type": "text", "text": "Sunny,"}, {"type": "text", "text": "21 C"}]):
        messages = history + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                            "content": content}]}]
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": messages,
                                              "tools": TOOLS, "tool_choice": {"type": "none"}})
        assert r.status_code == 200, r.text
        expected = content if isinstance(content, str) else "Sunny,\n21 C"
        assert r.json()["content"] == [{"type": "text", "text": expected}]


def test_system_and_prefill(make):
    client, context = make()
    context.model.tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    body = {"model": "m", "max_tokens": 100,
            "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    # Prefill: the last assistant turn is continued (no generation prompt after it).
    assert client.post("/v1/messages", json=body).json()["content"][0]["text"] == \
        "[system]Be\nbrief[user]hi[assistant]Hel"
    count = client.post("/v1/messages/count_tokens", json=body).json()
    assert count == {"input_tokens": len("[system]Be\nbrief[user]hi[assistant]Hel")}


def test_max_tokens_past_the_context_window_is_capped(client):
    # Anthropic clients send their model's output cap (the echo model's window is 512 tokens).
    msg = post(client, "abc", max_tokens=32000).json()
    assert msg["content"] == [{"type": "text", "text": "abc"}] and msg["stop_reason"] == "end_turn"
    msg = post(client, "a" * 300, max_tokens=32000).json()
    assert msg["stop_reason"] == "model_context_window_exceeded"
    assert msg["usage"]["output_tokens"] == 512 - 300


@pytest.mark.parametrize("extra, param_hint", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "at least one user or assistant message"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages.0.content.0.source.media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "unknown content block type"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     "tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "assistant messages"),
    ({"system": [{"type": "image"}]}, "system.0"),
    ({"tools": TOOLS}, "--enable-auto-tool-choice"),
    ({"tools": [{"name": "f"}], "tool_choice": {"type": "any"}}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "any"}},
     "server tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "other"}}, "not in tools"),
    ({"tool_choice": {"type": "any"}}, "tools must be given"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"output_config": {"format": {"type": "regex", "pattern": "a"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"grammar": "x"}}, "output_config.grammar"),
    ({"output_format": {"type": "json_schema", "schema": {}}, "output_config": {"format": {
        "type": "json_schema", "schema": {}}}}, "not both"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"}, "output_config": {"format": {
        "type": "json_schema", "schema": {}}}}, "cannot be combined"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
])
def test_bad_input_is_a_400_in_anthropics_format(make, extra, param_hint):
    client, _ = make()
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        r = client.post("/v1/messages", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert param_hint in r.json()["error"]["message"]
        assert r.headers["x-should-retry"] == "false"


def test_malformed_bodies_are_400s(make):
    client, _ = make()
    for raw in (b"{", b"[]", b"null", b'{"messages": "x", "max_tokens": 1}'):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, raw, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"


def test_no_chat_template_is_a_400(echo_app):
    client, _ = echo_app()
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 5,
                                          "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_unknown_model_under_strict_names_is_a_404(make):
    client, _ = make(strict_model_name=True)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json={"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_headers_and_beta_query_are_accepted(client):
    r = client.post("/v1/messages?beta=true", json={"model": "m", "max_tokens": 20,
                                                    "messages": [{"role": "user", "content": "hey"}]},
                    headers={"anthropic-version": "2023-06-01", "anthropic-beta": "output-128k-2025-02-19"})
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "hey"}]


def test_api_keys_by_x_api_key_and_bearer(make):
    client, _ = make(api_key=["sk-right"])
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hey"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.post(path, json=body, headers={"x-api-key": "sk-wrong"}).status_code == 401
        assert client.post(path, json=body, headers={"x-api-key": "sk-right"}).status_code == 200
        assert client.post(path, json=body, headers={"Authorization": "Bearer sk-right"}).status_code == 200


def test_overload_is_529(make):
    client, context = make()
    context.draining = True
    r = post(client, "hi")
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    assert "shutting down" in r.json()["error"]["message"]


def test_error_after_the_200_is_an_error_event(make, monkeypatch):
    # The echo needs ~7 s for this prompt at 0.05 s a token, so the request always times out; the
    # timeout counts from the request's arrival, so it leaves the stream (which may start late on a
    # loaded machine: a CI run once saw a single ping in a 0.5 s limit) many ping intervals.
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", "0.05")
    client, _ = make(request_timeout=1.5, sse_ping_interval=0.02)
    r = post(client, "x" * 150, stream=True)
    assert r.status_code == 200
    evs = events(r.text)
    assert evs[0][0] == "message_start" and evs[-1][0] == "error"
    assert evs[-1][1]["error"]["type"] == "timeout_error"
    # Keep-alive pings are Anthropic's ping events, never SSE comments.
    assert not any(line.startswith(":") for line in r.text.splitlines()) and sum(n == "ping" for n, _ in evs) >= 2


@pytest.mark.parametrize("error, status, kind", [
    (InvalidRequestError("x"), 400, "invalid_request_error"),
    (UnauthorizedError("x"), 401, "authentication_error"),
    (InvalidRequestError("x", status=403), 403, "permission_error"),
    (NotFoundError("x"), 404, "not_found_error"),
    (PayloadTooLargeError("x"), 413, "request_too_large"),
    (InvalidRequestError("x", status=429), 429, "rate_limit_error"),
    (InvalidRequestError("x", status=415), 400, "invalid_request_error"),
    (GenerationError("x"), 500, "api_error"),
    (EngineDeadError("x"), 500, "api_error"),
    (RequestTimeoutError("x"), 504, "timeout_error"),
    (OverloadedError("x"), 529, "overloaded_error"),
])
def test_core_errors_map_to_anthropic_statuses(error, status, kind):
    assert error_body(error) == (status, {"type": "error", "error": {"type": kind, "message": "x"}})


def test_routes_are_in_the_openapi_document(make):
    client, _ = make()
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        err = paths[path]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert err["required"] == ["type", "error"]
    assert "text/event-stream" in paths["/v1/messages"]["post"]["responses"]["200"]["content"]


def test_thinking_disabled_reaches_template_and_parser(thinker):
    # qwen3's parser reads the template switch: with thinking disabled, untagged output is text.
    msg = post(thinker, "plain answer", thinking={"type": "disabled"}).json()
    assert msg["content"] == [{"type": "text", "text": "plain answer"}]
    msg = post(thinker, "plain answer", thinking={"type": "enabled", "budget_tokens": 100}).json()
    assert [b["type"] for b in msg["content"]] == ["thinking"] and msg["content"][0]["thinking"] == "plain answer"


def test_reasoning_then_a_tool_call(thinker):
    said = "<think>Need the weather.</think>" + CALL
    msg = post(thinker, said, tools=TOOLS).json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "tool_use"] and msg["stop_reason"] == "tool_use"
    streamed = fold(events(post(thinker, said, stream=True, tools=TOOLS).text))
    assert [b["type"] for b in streamed["content"]] == ["thinking", "tool_use"]
    assert streamed["content"][1]["input"] == msg["content"][1]["input"] == {"city": "Oslo"}


def test_body_over_the_limit_is_413_request_too_large(make):
    client, _ = make(max_request_body_bytes=2048)
    r = post(client, "x" * 4096)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_system_messages_inside_messages_fold_into_the_system_prompt():
    """Claude Code sends ``role: "system"`` messages inside ``messages``: their text joins the
    ``system`` field's, in order, as the one system message chat templates expect first."""
    from llmserve.plugins.protocols.anthropic.params import chat_messages
    from llmserve.plugins.protocols.anthropic.wire import MessagesRequest

    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": "Be brief.", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "Reminder: use tools."},
        {"role": "user", "content": "go"}]})
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief.\n\nx-anthropic-billing-header: cch=1;\n\nReminder: use tools."},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "go"}]


def test_a_system_message_inside_messages_is_served(client):
    reply = client.post("/v1/messages", json={"model": "any", "max_tokens": 20, "messages": [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["content"][0]["text"] == "hi", reply.text
