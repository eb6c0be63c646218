"""Tool calling and reasoning on the chat route, on the echo backend: the model "says" what the
last user message says, so each test writes the model output it needs.

Covers the flags (--enable-auto-tool-choice, --tool-call-parser, --reasoning-parser,
--tool-parser-plugin), tool_choice validation, finish_reason, parallel_tool_calls and the
streamed deltas against the non-streamed message.
"""

from __future__ import annotations

import json

import pytest

from llmserve.errors import ConfigError

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
CALL_W = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich \\"old\\""}}</tool_call>'
CALL_A = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def sse_events(text: str) -> list[dict]:
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(client, said: str, stream: bool = False, **extra):
    body = {"messages": [{"role": "user", "content": said}], "disable_chat_template": True,
            "stream": stream, **extra}
    return client.post("/v1/chat/completions", json=body)


def assemble(events: list[dict]) -> tuple[dict, str | None]:
    """Fold streamed chat deltas into a message, checking the tool-call delta contract."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for ev in events:
        for choice in ev["choices"]:
            d = choice["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for call in d.get("tool_calls") or []:
                if call["index"] == len(msg["tool_calls"]):
                    assert call["id"] and call["type"] == "function" and call["function"]["name"]
                    msg["tool_calls"].append({"id": call["id"], "type": "function",
                                              "function": dict(call["function"])})
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                    msg["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return msg, finish


@pytest.fixture
def auto(echo_app):
    client, _ = echo_app(enable_auto_tool_choice=True, tool_call_parser="hermes")
    return client


def test_auto_without_flags_is_a_400_naming_them(echo_app):
    client, _ = echo_app()
    for extra in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = chat(client, "hi", **extra)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
        assert "--tool-call-parser" in err["message"]


def test_tool_choice_none_neither_offers_nor_parses(auto):
    r = chat(auto, "x " + CALL_W, tools=TOOLS, tool_choice="none")
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "x " + CALL_W}
    assert choice["finish_reason"] == "stop"


def test_auto_parses_calls_and_sets_finish_reason(auto):
    r = chat(auto, "Let me check. " + CALL_W + CALL_A, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me check."  # hermes drops the whitespace before a call
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "add"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": 'Zürich "old"'}
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])


def test_auto_without_a_call_is_plain_content(auto):
    choice = chat(auto, "no tools needed", tools=TOOLS).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no tools needed"}
    assert choice["finish_reason"] == "stop"


def test_streamed_deltas_assemble_to_the_message(auto):
    said = "Sure: " + CALL_W + " and " + CALL_A
    whole = chat(auto, said, tools=TOOLS).json()["choices"][0]
    events = sse_events(chat(auto, said, stream=True, tools=TOOLS).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    msg, finish = assemble(events)
    assert finish == "tool_calls" == whole["finish_reason"]
    assert msg["content"] == whole["message"]["content"]
    assert "<tool_call>" not in msg["content"] and "</tool_call>" not in msg["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    # A call of free model text arrives whole once it is complete and valid: one delta per call.
    pieces = [c for ev in events for ch in ev["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert [(p["index"], p["function"]["name"], "id" in p) for p in pieces] == [(0, "get_weather", True),
                                                                             (1, "add", True)]


def test_parallel_tool_calls_false_keeps_the_first_call(auto):
    said = CALL_W + CALL_A
    msg = chat(auto, said, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    streamed, _ = assemble(sse_events(chat(auto, said, stream=True, tools=TOOLS, parallel_tool_calls=False).text))
    assert [c["function"]["name"] for c in streamed["tool_calls"]] == ["get_weather"]


def test_truncated_call_reports_length(auto):
    # hermes: an open <tool_call> cut off inside its JSON is content, so nothing half-written runs.
    r = chat(auto, CALL_W, tools=TOOLS, max_tokens=62)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"].get("tool_calls")
    assert choice["message"]["content"].startswith('<tool_call>{"name": "get_weather", "arguments": {"city": "Z')


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_400s(auto, extra, param):
    r = chat(auto, "hi", **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_content_in_message_deltas_and_completions(echo_app):
    client, _ = echo_app(reasoning_parser="deepseek_r1")
    said = "<think>Paris is in France.</think>The capital is Paris."
    msg = chat(client, said).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "The capital is Paris.",
                   "reasoning": "Paris is in France.", "reasoning_content": "Paris is in France."}
    streamed, finish = assemble(sse_events(chat(client, said, stream=True).text))
    assert (streamed["content"], streamed["reasoning_content"]) == ("The capital is Paris.", "Paris is in France.")
    assert finish == "stop"
    r = client.post("/v1/completions", json={"prompt": said, "max_tokens": 200})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["reasoning_content"]) == ("The capital is Paris.", "Paris is in France.")
    events = sse_events(client.post("/v1/completions", json={"prompt": said, "max_tokens": 200,
                                                             "stream": True}).text)
    text = "".join(c["text"] for e in events for c in e["choices"])
    reasoning = "".join(c.get("reasoning_content") or "" for e in events for c in e["choices"])
    assert (text, reasoning) == ("The capital is Paris.", "Paris is in France.")


def test_reasoning_runs_before_tool_parsing(echo_app):
    client, _ = echo_app(reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes")
    said = "<think>I should call <tool_call> now</think>" + CALL_A
    msg = chat(client, said, tools=TOOLS).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should call <tool_call> now"
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["add"]


def test_auto_flag_alone_detects_the_parser_from_the_template(echo_app):
    # No parser named: auto. The echo model has no chat template, so no format is found and
    # tool calls stay off: tool_choice "auto" is refused as without the flag.
    client, context = echo_app(enable_auto_tool_choice=True)
    assert context.parsing.tool_parser is None and not context.parsing.auto_tools
    reply = chat(client, "hi", tools=TOOLS)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"


def test_unknown_parser_fails_at_start(echo_app):
    with pytest.raises(ConfigError, match="unknown tool parser 'nope'"):
        echo_app(tool_call_parser="nope")


def test_tool_parser_plugin_file_contributes_a_parser(echo_app, tmp_path):
    plugin = tmp_path / "bang_parser.py"
    plugin.write_text('''
from llmserve import hookimpl
from llmserve.hooks.records import ToolParserSpec
from llmserve.parsing.contract import ParseDelta, ToolCallDelta, ToolParser, new_call_id


class BangParser(ToolParser):
    """'!name' lines are calls without arguments; everything else is content."""

    def __init__(self, tokenizer=None, tools=None):
        super().__init__(tokenizer, tools)
        self.text = ""

    def feed(self, text, token_ids=()):
        self.text += text
        return ParseDelta()

    def finish(self):
        out, n = ParseDelta(), 0
        for line in self.text.splitlines():
            if line.startswith("!"):
                out.tool_calls.append(ToolCallDelta(n, new_call_id(), line[1:], "{}"))
                n += 1
            else:
                out.content += line
        return out


@hookimpl
def register_tool_parsers():
    return [ToolParserSpec(name="bang", target=__name__ + ":BangParser")]
''')
    client, _ = echo_app(enable_auto_tool_choice=True, tool_call_parser="bang", tool_parser_plugin=[str(plugin)])
    choice = chat(client, "hello\n!add", tools=TOOLS).json()["choices"][0]
    assert choice["message"]["content"] == "hello"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "add", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"


HISTORY_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}"
    "({{ c.function.arguments.city }}) {% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}{% endfor %}")


def test_tools_and_tool_history_reach_the_template(echo_app):
    client, _ = echo_app(trust_request_chat_template=True, enable_auto_tool_choice=True, tool_call_parser="hermes")
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    body = {"messages": messages, "tools": TOOLS, "chat_template": HISTORY_TEMPLATE}
    text = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert text == ("[tool get_weather][tool add]<user>weather?<assistant>call get_weather(Oslo) "
                    "<tool>[call_1] -3 C")
    none = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert not none.json()["choices"][0]["message"]["content"].startswith("[tool")


def kept_special_tokens(context, monkeypatch) -> dict[str, bool]:
    """Per request id, in order: whether the request keeps special tokens in its text."""
    seen: dict[str, bool] = {}
    preparer = context.engine.preparer  # the one place every route's request is prepared
    prepare = preparer.prepare

    def spy(req, *args, **kwargs):
        assert req.request_id not in seen, "a request is prepared once"
        seen[req.request_id] = not req.sampling.skip_special_tokens
        return prepare(req, *args, **kwargs)

    monkeypatch.setattr(preparer, "prepare", spy)
    return seen


def test_routes_keep_special_tokens_when_a_parser_declares_the_need(echo_app, monkeypatch, tmp_path):
    client, context = echo_app(enable_auto_tool_choice=True, tool_call_parser="hermes")
    seen = kept_special_tokens(context, monkeypatch)
    chat(client, "hi", tools=TOOLS)                       # hermes' markers are special tokens
    chat(client, "hi", tools=TOOLS, tool_choice="none")   # nothing parsed
    chat(client, "hi")
    chat(client, "hi", tools=TOOLS, skip_special_tokens=False)
    assert list(seen.values()) == [True, False, False, True]
    client, context = echo_app(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    seen = kept_special_tokens(context, monkeypatch)
    chat(client, "hi", tools=TOOLS)                       # pythonic needs none
    assert list(seen.values()) == [False]

    plugin = tmp_path / "marked_reasoning.py"
    plugin.write_text('''
from llmserve import hookimpl
from llmserve.hooks.records import ReasoningParserSpec
from llmserve.plugins.tool_parsers.reasoning import ThinkReasoningParser


class MarkedThink(ThinkReasoningParser):
    needs_special_tokens = True


@hookimpl
def register_reasoning_parsers():
    return [ReasoningParserSpec(name="marked", target=__name__ + ":MarkedThink")]
''')
    client, context = echo_app(reasoning_parser="marked", tool_parser_plugin=[str(plugin)])
    seen = kept_special_tokens(context, monkeypatch)
    said = "<think>hm</think>Yes."
    assert chat(client, said).json()["choices"][0]["message"]["reasoning_content"] == "hm"
    assert client.post("/v1/completions", json={"prompt": said, "max_tokens": 50}).json()[
        "choices"][0]["reasoning_content"] == "hm"
    chat(client, said, guided_regex="[a-z]+")             # constrained: no reasoning parser, no need
    assert list(seen.values()) == [True, True, False]
