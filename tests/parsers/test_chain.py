"""The chain and its factory, the assembler, OpenAI deltas, call ids, declared needs, per-request state."""

from __future__ import annotations

import re

import pytest

from llmserve.errors import ConfigError
from llmserve.parsing.chain import Assembler, ParseChain, StreamContractError
from llmserve.parsing.contract import ParseDelta, ToolCallDelta, new_call_id, seed_call_ids
from llmserve.parsing.forced import NamedCallParser, RequiredCallsParser
from llmserve.parsing.tool_choice import plan_tools
from llmserve.plugins.protocols.openai.deltas import openai_delta
from llmserve.plugins.tool_parsers.hermes import HermesToolParser
from llmserve.plugins.tool_parsers.mistral import MistralToolParser
from llmserve.plugins.tool_parsers.pythonic import PythonicToolParser
from llmserve.plugins.tool_parsers.reasoning import Qwen3ReasoningParser

from .cases import ALL_TOOL_CASES, HERMES, MISTRAL, case_id
from .helpers import chain, registry

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def test_openai_delta_shapes():
    assert openai_delta(ParseDelta()) is None
    assert openai_delta(ParseDelta(content="hi", reasoning="hm")) == {"reasoning": "hm", "reasoning_content": "hm",
                                                                       "content": "hi"}
    assert openai_delta(ParseDelta(reasoning="hm"), reasoning_keys=("reasoning",)) == {"reasoning": "hm"}
    first = ToolCallDelta(0, id="call_x", name="f", arguments="")
    assert openai_delta(ParseDelta(tool_calls=[first, ToolCallDelta(0, arguments='{"a"')])) == {"tool_calls": [
        {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a"'}}]}


def test_streamed_deltas_follow_the_openai_shape():
    c = ParseChain(HermesToolParser())
    closes = CALL.index("}}") + 2  # where the call object is complete
    deltas = [openai_delta(c.feed(ch)) for ch in CALL] + [openai_delta(c.finish())]
    # A call of free model text is sent once it is complete and valid: nothing before the
    # object closes, then one delta with the id, the name and the whole arguments.
    assert not any(deltas[:closes - 1])
    pieces = [call for d in deltas if d for call in d.get("tool_calls", [])]
    assert deltas[closes - 1] == {"tool_calls": pieces}
    assert len(pieces) == 1 and pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function"
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}
    assert not any(d and "content" in d for d in deltas)
    assert c.tools_called


def test_a_name_is_never_split_and_comes_with_the_id():
    for case in HERMES + MISTRAL:
        c = chain(case)
        for ch in case.text:
            for piece in c.feed(ch).tool_calls:
                assert (piece.id is None) == (piece.name is None)
        c.finish()


def test_assembler_result_shape_and_strict_checks():
    a = Assembler()
    assert a.result() == {"content": None, "reasoning_content": None, "tool_calls": []}
    a.add(ParseDelta(content="x", tool_calls=[ToolCallDelta(0, id="i", name="f", arguments="{")]))
    a.add(ParseDelta(tool_calls=[ToolCallDelta(0, arguments="}")]))
    assert a.result() == {"content": "x", "reasoning_content": None,
                          "tool_calls": [{"id": "i", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    strict = Assembler(strict=True)
    with pytest.raises(StreamContractError, match="needs an id"):
        strict.add(ParseDelta(tool_calls=[ToolCallDelta(0, arguments="{}")]))
    strict.add(ParseDelta(tool_calls=[ToolCallDelta(0, id="i", name="f")]))
    with pytest.raises(StreamContractError, match="only its first delta"):
        strict.add(ParseDelta(tool_calls=[ToolCallDelta(0, id="j", name="f")]))
    with pytest.raises(StreamContractError, match="out of order"):
        strict.add(ParseDelta(tool_calls=[ToolCallDelta(2, id="k", name="g")]))


def test_parse_delta_extend_merges_argument_pieces():
    d = ParseDelta(tool_calls=[ToolCallDelta(0, id="i", name="f", arguments="{")])
    d.extend(ParseDelta(content="c", tool_calls=[ToolCallDelta(0, arguments="}"), ToolCallDelta(1, id="j", name="g")]))
    assert d.content == "c" and [(t.index, t.arguments) for t in d.tool_calls] == [(0, "{}"), (1, "")]
    assert ParseDelta().is_empty() and not d.is_empty()


def test_call_ids():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id(9, ""))
    assert new_call_id() != new_call_id()
    mistral = ParseChain(MistralToolParser()).parse('[TOOL_CALLS]f{}[TOOL_CALLS]g[CALL_ID]abc123XYZ[ARGS]{}')
    first, second = (c["id"] for c in mistral["tool_calls"])
    assert re.fullmatch(r"[A-Za-z0-9]{9}", first) and second == "abc123XYZ"


def test_seeded_ids_are_deterministic(seeded_ids):
    one = ParseChain(HermesToolParser()).parse(CALL)["tool_calls"][0]["id"]
    seed_call_ids(1234)
    assert ParseChain(HermesToolParser()).parse(CALL)["tool_calls"][0]["id"] == one


def test_parsers_declare_special_tokens_and_never_touch_the_request():
    assert HermesToolParser().needs_special_tokens and MistralToolParser().needs_special_tokens
    assert not PythonicToolParser().needs_special_tokens and not Qwen3ReasoningParser().needs_special_tokens
    assert not hasattr(HermesToolParser(), "adjust_request")
    assert ParseChain(MistralToolParser(), Qwen3ReasoningParser()).needs_special_tokens
    assert ParseChain(None, Qwen3ReasoningParser()).needs_special_tokens is False
    assert ParseChain(PythonicToolParser()).needs_special_tokens is False
    assert ParseChain().needs_special_tokens is False
    # Forced output is JSON: neither forced parser asks for special tokens.
    assert not ParseChain(RequiredCallsParser()).needs_special_tokens
    assert not ParseChain(NamedCallParser("f")).needs_special_tokens


def test_create_from_registry_and_unknown_names():
    c = ParseChain.create(registry(), tool_parser="llama4_json", reasoning_parser="qwen3",
                          chat_template_kwargs={"enable_thinking": False})
    assert type(c.tool_parser).__name__ == "Llama3JsonToolParser"
    assert c.reasoning_parser.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="unknown tool parser 'nope'; available: .*\\bgranite, hermes, "):
        ParseChain.create(registry(), tool_parser="nope")
    with pytest.raises(ConfigError, match="unknown reasoning parser 'nope'"):
        ParseChain.create(registry(), reasoning_parser="nope")
    assert ParseChain().parse("plain") == {"content": "plain", "reasoning_content": None, "tool_calls": []}


FACTORY_TOOLS = [{"type": "function", "function": {"name": "search"}}]


def factory_plan(tool_choice):
    return plan_tools(FACTORY_TOOLS, tool_choice, None, auto_enabled=True, tool_parser="hermes")


def make(**kwargs):
    return ParseChain.factory(registry(), tool_parser="hermes", reasoning_parser="qwen3", **kwargs)


def test_factory_follows_the_tool_plan():
    auto = make(plan=factory_plan("auto"))()
    assert type(auto.tool_parser).__name__ == "HermesToolParser" and auto.tool_parser.tools == FACTORY_TOOLS
    assert type(auto.reasoning_parser).__name__ == "Qwen3ReasoningParser"
    none = make(plan=factory_plan("none"))()
    assert none.tool_parser is None and type(none.reasoning_parser).__name__ == "Qwen3ReasoningParser"
    required = make(plan=factory_plan("required"))()
    assert type(required.tool_parser) is RequiredCallsParser and required.reasoning_parser is None
    named = make(plan=factory_plan({"type": "function", "function": {"name": "search"}}))()
    assert type(named.tool_parser) is NamedCallParser and named.tool_parser.name == "search"
    assert named.parse('{"q": 1}')["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": 1}'}


def test_factory_leaves_reasoning_out_of_constrained_output_and_says_when_nothing_parses():
    constrained = make(plan=factory_plan("auto"), constrained=True)()
    assert constrained.reasoning_parser is None and constrained.tool_parser is not None
    assert make(plan=factory_plan("none"), constrained=True) is None
    assert ParseChain.factory(registry()) is None
    assert ParseChain.factory(registry(), reasoning_parser="qwen3", constrained=True) is None
    chains = [make(chat_template_kwargs={"enable_thinking": False})() for _ in range(2)]
    assert chains[0].reasoning_parser is not chains[1].reasoning_parser  # fresh parsers per choice
    assert chains[0].reasoning_parser.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="unknown tool parser 'nope'"):
        ParseChain.factory(registry(), tool_parser="nope", plan=factory_plan("auto"))


def test_tools_are_passed_to_the_parser():
    tools = [{"type": "function", "function": {"name": "search"}}]
    c = ParseChain.create(registry(), tool_parser="internlm", tools=tools)
    assert c.tool_parser.tools == tools and c.tool_parser.tool_names == {"search"}


@pytest.mark.parametrize("case", ALL_TOOL_CASES[::3], ids=case_id)
def test_interleaved_requests_share_no_state(case):
    """Two requests streamed in lockstep through parsers of the same class do not interfere."""
    expected = chain(case).parse(case.text)
    other_text = "<tool_call>{" + case.text[::-1]
    a, b = chain(case), chain(case)
    for i in range(max(len(case.text), len(other_text))):
        a.feed(case.text[i:i + 1])
        b.feed(other_text[i:i + 1])
    a.finish()
    b.finish()
    strip = [(c["function"]["name"], c["function"]["arguments"]) for c in a.result()["tool_calls"]]
    assert strip == [(c["function"]["name"], c["function"]["arguments"]) for c in expected["tool_calls"]]
    assert a.result()["content"] == expected["content"]


def test_feed_after_finish_is_an_error_and_finish_is_idempotent():
    p = HermesToolParser()
    assert p.feed("hello ").content == "hello"  # trailing whitespace waits for what follows
    assert p.finish().content == " "
    assert p.finish().is_empty()
    with pytest.raises(RuntimeError):
        p.feed("more")
