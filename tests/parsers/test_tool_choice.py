"""``llmserve.parsing.tool_choice``: the plan for each tool_choice and the forced schemas; and
``llmserve.parsing.forced``: the parsers that read forced output, split at every position."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmserve.errors import InvalidRequestError
from llmserve.parsing.chain import ParseChain
from llmserve.parsing.forced import NamedCallParser, RequiredCallsParser
from llmserve.parsing.tool_choice import plan_tools

from .helpers import structure

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}},
]


def plan(tool_choice, tools=TOOLS, parallel=None, auto=True):
    return plan_tools(tools, tool_choice, parallel, auto_enabled=auto, tool_parser="hermes" if auto else None)


def test_default_is_none_without_tools_and_auto_with_them():
    assert plan(None, tools=None).mode == "none"
    p = plan(None)
    assert p.mode == "auto" and p.offered == TOOLS and p.schema is None


def test_none_offers_no_tools():
    p = plan("none")
    assert p.mode == "none" and p.offered is None


def test_auto_needs_the_server_flags():
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice") as err:
        plan("auto", auto=False)
    assert err.value.param == "tool_choice"


def test_required_schema_accepts_calls_and_rejects_others():
    schema = plan("required").schema
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan("required", parallel=False).schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    jsonschema.validate(good[:1], single)


def test_named_function_schema_is_its_parameters():
    p = plan({"type": "function", "function": {"name": "get_weather"}})
    assert p.mode == "forced" and p.forced_name == "get_weather"
    assert p.schema == TOOLS[0]["function"]["parameters"]
    assert plan({"type": "function", "function": {"name": "ping"}}).schema["type"] == "object"


ARRAY_OUTPUTS = [
    ('[{"name": "get_weather", "arguments": {"city": "Pa\\"ris \\u00e9"}}]',
     [("get_weather", '{"city": "Pa\\"ris \\u00e9"}')]),
    ('[ {"arguments": {"city": "Zürich", "n": [1, {"a": "}"}]}, "name": "get_weather"} ,\n'
     ' {"name":"ping","arguments":{}} ]',
     [("get_weather", '{"city": "Zürich", "n": [1, {"a": "}"}]}'), ("ping", "{}")]),
    # Forced output is read by the streamed CallList (json_calls.arguments_from_value): null
    # arguments are "{}" (the tool parsers' checked rule makes such an object no call).
    ('[{"name": "ping", "arguments": null}]', [("ping", "{}")]),
]


@pytest.mark.parametrize("text, calls", ARRAY_OUTPUTS)
def test_required_calls_parser_same_result_for_every_split(text, calls):
    expected = {"content": None, "reasoning_content": None, "tool_calls": calls}
    assert structure(ParseChain(RequiredCallsParser(), strict=True).parse(text)) == expected
    for cut in range(1, len(text)):
        ch = ParseChain(RequiredCallsParser(), strict=True)
        ch.feed(text[:cut])
        ch.feed(text[cut:])
        ch.finish()
        assert structure(ch.result()) == expected, cut
    for size in (1, 3, 7):
        ch = ParseChain(RequiredCallsParser(), strict=True)
        for i in range(0, len(text), size):
            ch.feed(text[i:i + size])
        ch.finish()
        assert structure(ch.result()) == expected


def test_required_calls_parser_streams_arguments_before_the_call_ends():
    ch = ParseChain(RequiredCallsParser(), strict=True)
    first = ch.feed('[{"name": "get_weather", "arguments": {"ci')
    # Arguments go out up to the last point that can still be closed into valid JSON.
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "get_weather", "{")]
    second = ch.feed('ty": "Pa')
    assert [(c.index, c.name, c.arguments) for c in second.tool_calls] == [(0, None, '"city": "Pa')]


def test_required_calls_parser_closes_cut_off_arguments_and_drops_the_rest():
    ch = ParseChain(RequiredCallsParser(), strict=True)
    cut_off = '[{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Pa'
    assert structure(ch.parse(cut_off)) == {"content": None, "reasoning_content": None,
                                            "tool_calls": [("ping", "{}"), ("get_weather", '{"city": "Pa"}')]}
    # Cut off before any name: nothing to call, and forced JSON is never content.
    assert ParseChain(RequiredCallsParser()).parse('[{"arguments": {"city": "Pa') == \
        {"content": None, "reasoning_content": None, "tool_calls": []}


def test_named_call_parser_every_split():
    text = ' {"city": "Oslo"}'
    for cut in range(len(text) + 1):
        ch = ParseChain(NamedCallParser("get_weather"), strict=True)
        ch.feed(text[:cut])
        ch.feed(text[cut:])
        ch.finish()
        assert structure(ch.result())["tool_calls"] == [("get_weather", '{"city": "Oslo"}')]
        assert json.loads(ch.result()["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
