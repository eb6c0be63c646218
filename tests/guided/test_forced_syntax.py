"""Forced tool calls in a family's own syntax (``ToolParser.forced_calls``), through the real
lm-format-enforcer decoder and the family's own parser.

The masks are driven by a seeded random walk over the allowed tokens of the generated tokenizer
of ``tests/forced_model.py`` (every printable character a token, the families' tags whole
regular tokens, harmony's markers special tokens), leaning towards tokens that hold marker
characters (``<``, ``/``, ``|``, ``"``) so the walk keeps trying to break out of values. Every
finished text must parse through the family's parser into calls of the offered tools whose
arguments validate under the tools' schemas.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from llmserve.errors import InvalidRequestError
from llmserve.guided import GuidedDecoding, GuidedSpec
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry
from llmserve.parsing.service import ParsingService
from llmserve.parsing.tool_choice import plan_tools
from llmserve.plugins.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from llmserve.plugins.tool_parsers.glm45 import Glm45ToolParser
from llmserve.plugins.tool_parsers.granite import GraniteToolParser
from llmserve.plugins.tool_parsers.harmony import OpenAIToolParser
from llmserve.plugins.tool_parsers.hermes import HermesToolParser
from llmserve.plugins.tool_parsers.internlm import InternLMToolParser
from llmserve.plugins.tool_parsers.jamba import JambaToolParser
from llmserve.plugins.tool_parsers.kimi_k2 import KimiK2ToolParser
from llmserve.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from llmserve.plugins.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from llmserve.plugins.tool_parsers.mistral import MistralToolParser
from llmserve.plugins.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from llmserve.plugins.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from llmserve.plugins.tool_parsers.seed_oss import SeedOssToolParser

from forced_model import HARMONY, build_tokenizer

ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 10},
                                            "next": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
           "required": ["street", "next"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"}, "hourly": {"type": "boolean"}, "scale": {"type": "number"},
            "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"},
                                         "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                         "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                  "required": ["x"]}},
        "required": ["a", "opts"]}}},
    {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Address": ADDRESS},
        "properties": {"to": {"$ref": "#/$defs/Address"}, "code": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["to", "code"]}}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}
FAMILIES = {"qwen3_coder": Qwen3CoderToolParser, "hermes": HermesToolParser, "openai": OpenAIToolParser,
            "seed_oss": SeedOssToolParser, "minimax_m2": MiniMaxM2ToolParser, "glm45": Glm45ToolParser,
            "kimi_k2": KimiK2ToolParser, "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser,
            "mistral": MistralToolParser, "llama3_json": Llama3JsonToolParser, "granite": GraniteToolParser,
            "jamba": JambaToolParser, "internlm": InternLMToolParser, "phi4_mini_json": Phi4MiniJsonToolParser}


@pytest.fixture(scope="module", params=["qwen3-coder", "gpt-oss"])
def setup(request):
    tok = build_tokenizer(request.param)
    eos = [tok.convert_tokens_to_ids(t) for t in (("<|return|>", "<|call|>") if request.param == "gpt-oss"
                                                   else ("<|im_end|>",))]
    registry = Registry.collect(PluginManager().load(autoload=False))
    guided = GuidedDecoding(registry, "lm-format-enforcer", tok, len(tok), eos)
    return tok, eos, guided


def walk(factory, tok, eos: list[int], seed: int, max_steps: int = 4000) -> list[int]:
    """A random walk of allowed tokens until end-of-sequence (taken half the time it is allowed)."""
    rng, mask, out = random.Random(seed), factory(), []
    marked = {i for i in range(len(tok)) if any(c in tok.decode([i]) for c in '<>/|"\\\n')}
    for _ in range(max_steps):
        allowed = mask.allowed(out)
        if any(e in allowed for e in eos) and (rng.random() < 0.5 or all(a in eos for a in allowed)):
            return out
        pool = sorted(a for a in allowed if a not in eos)  # a fixed order: the seeded walk repeats exactly
        tricky = [a for a in pool if a in marked]
        out.append(rng.choice(tricky if tricky and rng.random() < 0.5 else pool))
    raise AssertionError(f"no end after {max_steps} tokens: {tok.decode(out, skip_special_tokens=False)[-300:]!r}")


def parse(cls, text: str) -> tuple[list[tuple[str, dict]], str]:
    parser = cls(None, TOOLS)
    delta = parser.feed(text)
    delta.extend(parser.finish())
    calls: dict[int, list[str]] = {}
    for piece in delta.tool_calls:
        calls.setdefault(piece.index, [piece.name or "", ""])[1] += piece.arguments
    return [(name, json.loads(args)) for name, args in calls.values()], delta.content


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("choice", ["required", "required-one", "named"])
def test_every_walk_parses_into_valid_calls(setup, family, choice):
    tok, eos, guided = setup
    cls = FAMILIES[family]
    name = "ship" if choice == "named" else None
    structure = cls.forced_calls(TOOLS, name, choice == "required")
    factory = guided.compile(GuidedSpec("structure", structure, param="tool_choice"))
    seen = set()
    for seed in range(12):
        ids = walk(factory, tok, eos, seed)
        text = tok.decode(ids, skip_special_tokens=False)
        calls, content = parse(cls, text)
        assert calls and not content.strip(), text
        if choice != "required" or family == "openai":  # harmony: <|call|> ends the turn, one call
            assert len(calls) == 1, text
        for called, arguments in calls:
            assert called == name or (name is None and called in SCHEMAS), text
            jsonschema.validate(arguments, SCHEMAS[called])
            seen.add(called)
        # Markers that are special tokens are written as those tokens, never spelled out.
        words = HARMONY if family == "openai" else getattr(getattr(cls, "layout", None), "words", ())
        special = set(words) & set(tok.all_special_tokens)
        assert not any(m in tok.decode(ids, skip_special_tokens=True) for m in special), text
        if family == "openai":
            assert tok.convert_tokens_to_ids("<|channel|>") == ids[0]
    assert len(seen) >= (1 if name else 2)


def test_the_same_structure_is_compiled_once(setup):
    _, _, guided = setup
    a = guided.compile(GuidedSpec("structure", HermesToolParser.forced_calls(TOOLS), param="tool_choice"))
    b = guided.compile(GuidedSpec("structure", json.loads(json.dumps(HermesToolParser.forced_calls(TOOLS))),
                                  param="tool_choice"))
    assert a is b


def tool(properties: dict, required: list[str] | None = None, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required or []}}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ten_thousand_parameters_are_a_400(setup, family):
    tools = [tool({f"p{i}": {"type": "integer"} for i in range(10_000)}, ["p0"])]
    with pytest.raises(InvalidRequestError) as err:
        setup[2].compile(GuidedSpec("structure", FAMILIES[family].forced_calls(tools), param="tool_choice"))
    assert err.value.param == "tool_choice" and "at most" in err.value.message


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deep_or_huge_schemas_are_a_400(setup, family):
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    huge = {"type": "string", "enum": ["x" * 60 + str(i) for i in range(1000)]}
    for tools in ([tool({"a": deep}, ["a"])], [tool({"a": huge}, ["a"])]):
        with pytest.raises(InvalidRequestError) as err:
            setup[2].compile(GuidedSpec("structure", FAMILIES[family].forced_calls(tools), param="tool_choice"))
        assert err.value.param == "tool_choice"


def test_xml_names_that_collide_with_markers(setup):
    tok, eos, guided = setup
    bad = tool({"</parameter>": {"type": "string"}, "ok": {"type": "integer"}}, ["</parameter>"])
    with pytest.raises(InvalidRequestError, match="cannot be written") as err:
        Qwen3CoderToolParser.forced_calls([bad])
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="cannot be written"):
        Qwen3CoderToolParser.forced_calls([tool({}, name="a b")])
    with pytest.raises(InvalidRequestError, match="harmony recipient"):
        OpenAIToolParser.forced_calls([tool({}, name="a<b")])
    # An optional parameter the syntax cannot name is left out; the call still parses.
    optional = [tool({"</parameter>": {"type": "string"}, "ok": {"type": "integer"}}, ["ok"])]
    factory = guided.compile(GuidedSpec("structure", Qwen3CoderToolParser.forced_calls(optional, "f"),
                                        param="tool_choice"))
    text = tok.decode(walk(factory, tok, eos, 1), skip_special_tokens=False)
    parser = Qwen3CoderToolParser(None, optional)
    delta = parser.feed(text)
    delta.extend(parser.finish())
    assert [c.name for c in delta.tool_calls if c.name] == ["f"]
    assert set(json.loads("".join(c.arguments for c in delta.tool_calls))) == {"ok"}


@pytest.mark.parametrize("cls", [KimiK2ToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser, MistralToolParser])
@pytest.mark.parametrize("bad", ["a b", "a<b", "a{b}"])
def test_bare_names_the_reader_would_not_take_back_are_a_400(cls, bad):
    with pytest.raises(InvalidRequestError, match="cannot be written") as err:
        cls.forced_calls([tool({}, name=bad)])
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser, JambaToolParser, InternLMToolParser])
def test_json_names_are_escaped_and_read_back(setup, cls):
    tok, eos, guided = setup
    odd = [tool({"a": {"type": "integer"}}, ["a"], name='say "hi"\\ x')]
    factory = guided.compile(GuidedSpec("structure", cls.forced_calls(odd, None, True), param="tool_choice"))
    for seed in range(3):
        text = tok.decode(walk(factory, tok, eos, seed), skip_special_tokens=False)
        parser = cls(None, odd)
        delta = parser.feed(text)
        delta.extend(parser.finish())
        assert {c.name for c in delta.tool_calls if c.name} == {'say "hi"\\ x'}, text
    with pytest.raises(InvalidRequestError, match="cannot be written"):  # the name would end the block
        JambaToolParser.forced_calls([tool({}, name="</tool_calls>")])


def test_a_kimi_header_written_twice_gets_a_fresh_id():
    call = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    parser = KimiK2ToolParser(None, [tool({})])
    delta = parser.feed("<|tool_calls_section_begin|>" + call * 2 + "<|tool_calls_section_end|>")
    delta.extend(parser.finish())
    ids = [c.id for c in delta.tool_calls if c.name]
    assert ids[0] == "functions.f:0" and len(ids) == 2 and ids[1] != ids[0]


@pytest.mark.parametrize("value, message", [
    ({"nope": 1}, "exactly one of"),
    ({"text": 1}, "text must be a string"),
    ({"repeat": {"text": "a"}, "min": 2, "max": 1}, "repeat needs"),
    ({"repeat": {"text": "a"}, "min": 0, "max": 5000}, "repeat needs"),
    ({"free_text": {"without": [""]}}, "'without'"),
    ({"free_text": {"without": ["x"], "max_length": 0}}, "free_text needs"),
    ({"one_of": []}, "non-empty"),
    ({"json": {"type": "object"}, "without": "x"}, "'without'"),
])
def test_malformed_structures_are_a_400(setup, value, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        setup[2].compile(GuidedSpec("structure", value, param="tool_choice"))
    assert err.value.param == "tool_choice"


def test_a_deeply_nested_structure_is_a_400(setup):
    value: dict = {"text": "a"}
    for _ in range(200):
        value = {"sequence": [value]}
    with pytest.raises(InvalidRequestError, match="levels deep"):
        setup[2].compile(GuidedSpec("structure", value, param="tool_choice"))


class _Registry:
    def __init__(self, cls):
        self.cls = cls

    def load(self, group, name):
        return self.cls


@pytest.mark.parametrize("parser, kind", [*((p, "structure") for p in [*FAMILIES, "glm47"]),
                                          ("pythonic", "json_schema"), ("lfm2", "json_schema")])
def test_the_service_asks_the_parser_and_reads_with_it(parser, kind):
    from llmserve.config import ParsingConfig

    registry = Registry.collect(PluginManager().load(autoload=False))
    service = ParsingService.from_config(ParsingConfig(tool_call_parser=parser), registry)
    plan = plan_tools(TOOLS, "required", False, auto_enabled=False, tool_parser=parser)
    spec = service.forced_spec(plan)
    assert spec.kind == kind and spec.param == "tool_choice"
    chains = service.chains(None, plan, constrained=True, native=spec.kind == "structure")
    chain = chains.make()
    if kind == "structure":
        assert type(chain.tool_parser) is service.tool_cls  # the family's parser, keeping its marker tokens
        assert chains.needs_special_tokens == service.tool_cls.needs_special_tokens  # phi4_mini's are plain text
    else:  # no hook: today's JSON, read by the forced-JSON parser
        assert type(chain.tool_parser).__name__ == "RequiredCallsParser"


def test_the_writing_a_parser_example_forces_its_own_syntax(setup):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-parser.md").read_text()
    namespace: dict = {}
    for marker in ("class CallTagParser", "def forced_calls"):
        (block,) = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if marker in b]
        exec(compile(block, "doc", "exec"), namespace)
    cls = namespace["ForcedCallTagParser"]
    tok, eos, guided = setup
    factory = guided.compile(GuidedSpec("structure", cls.forced_calls(TOOLS, None, True), param="tool_choice"))
    for seed in range(6):
        calls, content = parse(cls, tok.decode(walk(factory, tok, eos, seed), skip_special_tokens=False))
        assert calls and not content
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
