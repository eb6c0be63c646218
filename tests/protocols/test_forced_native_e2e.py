"""Forced tool calls in the family's own syntax, end to end: a generated tiny model carrying the
family's chat template (``tests/forced_model.py``) served with its tool parser, asked through
the openai client (``tool_choice`` ``required`` and a named function, streamed and whole) and
the anthropic client (``tool_choice`` ``any``). The random model writes noise; the constraint
makes it the family's call syntax, which the family's parser reads back into calls whose
arguments validate. (Ollama's API has no field that forces a call.)
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import ServerProcess
from forced_model import build_forced_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer"}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = {"qwen3-coder": "qwen3_coder", "gpt-oss": "openai"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def server(request, tmp_path_factory):
    path = build_forced_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    proc = ServerProcess(path, "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048",
                         "--tool-call-parser", FAMILIES[request.param], "--served-model-name", "tiny",
                         "--log-level", "warning")
    try:
        yield proc.wait_ready(timeout=300)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=240)


def check(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def create(oai, stream: bool, **extra):
    args = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=0, **extra)
    if not stream:
        choice = oai.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    calls: list[list[str]] = []
    content, finish = "", None
    for chunk in oai.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or []:
                if piece.index == len(calls):
                    calls.append([piece.function.name, piece.function.arguments or ""])
                else:
                    calls[piece.index][1] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    return [tuple(c) for c in calls], content or None, finish


@pytest.mark.parametrize("parallel", [False, True])
def test_required_returns_calls_that_parse(oai, parallel):
    whole = create(oai, False, tool_choice="required", parallel_tool_calls=parallel)
    streamed = create(oai, True, tool_choice="required", parallel_tool_calls=parallel)
    assert whole == streamed  # greedy: the same text, read by the same parser
    calls, content, finish = whole
    assert calls and not content and finish == "tool_calls"
    if not parallel:
        assert len(calls) == 1
    for name, arguments in calls:
        check(name, arguments)


def test_a_named_function_is_called(oai):
    calls, _, finish = create(oai, False, tool_choice={"type": "function", "function": {"name": "add"}})
    assert [name for name, _ in calls] == ["add"] and finish == "tool_calls"
    check(*calls[0])


def test_forced_with_another_constraint_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        create(oai, False, tool_choice="required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


def test_anthropic_any_returns_a_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=240)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msg = client.messages.create(model="tiny", max_tokens=300, messages=ASK, tools=tools,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and msg.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    named = client.messages.create(model="tiny", max_tokens=300, messages=ASK, tools=tools,
                                   extra_body={"temperature": 0}, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
