"""The schema typing shared by the XML-style tool parsers (``xml_params``), and their answers to
hostile output: recursive schemas, 10k parameters, huge and deeply nested values, parameter
names that are the format's own markers. The time these take is checked in test_linear.py."""

from __future__ import annotations

import json

import pytest

from llmserve.parsing.chain import ParseChain
from llmserve.plugins.tool_parsers.xml_params import arguments_json, declared_types, typed_value

from .helpers import registry


@pytest.mark.parametrize("schema, raw, expected", [
    ({"type": "string"}, " 42 ", " 42 "),
    ({"type": ["string", "integer"]}, "42", "42"),
    ({}, "42", "42"),
    (None, "true", "true"),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " 5.0 ", 5),
    ({"type": "integer"}, "5.5", "5.5"),
    ({"type": "integer"}, "true", "true"),
    ({"type": "number"}, "-1.5e3", -1500.0),
    ({"type": "number"}, "1e999", "1e999"),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "number"}, "0x10", "0x10"),
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "1", "1"),
    ({"type": "null"}, "null", None),
    ({"type": "null"}, "None", None),
    ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ({"type": "object"}, "{'a': 1}", "{'a': 1}"),
    ({"type": "object"}, "__import__('os')", "__import__('os')"),
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, '{"a": 1}', '{"a": 1}'),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", None),
    ({"oneOf": [{"type": "array"}, {"type": "object"}]}, "[]", []),
])
def test_typed_value(schema, raw, expected):
    value = typed_value(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_local_refs_are_followed_and_loops_are_harmless():
    root = {"$defs": {"N": {"type": "integer"}, "Loop": {"$ref": "#/$defs/Loop"},
                      "A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
    assert declared_types({"$ref": "#/$defs/N"}, root) == {"integer"}
    assert declared_types({"$ref": "#/$defs/Loop"}, root) == set()
    assert declared_types({"$ref": "#/$defs/A"}, root) == set()
    assert declared_types({"$ref": "https://example.com/s.json"}, root) == set()
    assert typed_value("3", {"$ref": "#/$defs/Loop"}, root) == "3"


def test_deep_values_stay_strings_and_the_arguments_stay_json():
    deep = "[" * 100_000 + "]" * 100_000
    args = arguments_json([("a", deep), ("b", "1")], {"properties": {"a": {"type": "array"},
                                                                      "b": {"type": "integer"}}})
    assert json.loads(args) == {"a": deep, "b": 1}


def test_a_parameter_given_twice_keeps_the_last_value_in_the_first_place():
    assert arguments_json([("a", "1"), ("b", "2"), ("a", "3")], None) == '{"a": "3", "b": "2"}'


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(10_000)}}}}]


@pytest.mark.parametrize("name, block", [
    ("qwen3_coder", "<tool_call>\n<function=f>\n{}</function>\n</tool_call>"),
    ("seed_oss", "<seed:tool_call><function=f>{}</function></seed:tool_call>"),
    ("glm45", "<tool_call>f\n{}</tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="f">{}</invoke></minimax:tool_call>'),
])
def test_ten_thousand_parameters_and_a_huge_value(name, block):
    param = {"qwen3_coder": "<parameter={}>\n{}\n</parameter>\n", "seed_oss": "<parameter={}>{}</parameter>",
             "glm45": "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n",
             "minimax_m2": '<parameter name="{}">{}</parameter>'}[name]
    chain = ParseChain.create(registry(), tool_parser=name, tools=TOOLS)
    text = block.format("".join(param.format(f"k{i}", i) for i in range(10_000)))
    calls = chain.parse(text)["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {f"k{i}": i for i in range(10_000)}
    huge = "x" * 2_000_000
    calls = ParseChain.create(registry(), tool_parser=name, tools=TOOLS).parse(
        block.format(param.format("k0", huge)))["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"k0": huge}


@pytest.mark.parametrize("name, text", [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=<tool_call>>\n1\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=</function>>\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>f\n<arg_key></arg_key></arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="</invoke>"></invoke></minimax:tool_call>'),
])
def test_names_that_are_markers_are_not_calls(name, text):
    result = ParseChain.create(registry(), tool_parser=name, tools=TOOLS).parse(text)
    assert result == {"content": text, "reasoning_content": None, "tool_calls": []}
