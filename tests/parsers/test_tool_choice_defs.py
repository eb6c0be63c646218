"""Forced tool calls over parameter schemas with local definitions (what pydantic generates for
a model that nests another): the ``required`` array schema carries every tool's ``$defs`` under
per-tool keys, so it validates, compiles for guided decoding, and keeps same-named definitions
of different tools apart."""

from __future__ import annotations

import copy

import jsonschema
import pytest
from pydantic import BaseModel

from llmserve.parsing.tool_choice import plan_tools
from llmserve.plugins.guided.schema import prepare_schema


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    home: Address
    previous: list[Address] = []


class Node(BaseModel):
    label: str
    children: list["Node"] = []


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def required(tools: list[dict]) -> dict:
    schema = plan_tools(tools, "required", None, auto_enabled=False, tool_parser=None).schema
    assert schema is not None
    return schema


PERSON = {"name": "Ada", "home": {"street": "1 Main St", "city": "Oslo"},
          "previous": [{"street": "2 Side St", "city": "Bergen"}]}


def test_nested_pydantic_model_makes_a_schema_the_decoder_accepts():
    tools = [tool("save_person", Person.model_json_schema())]
    before = copy.deepcopy(tools)
    schema = required(tools)
    prepare_schema(schema, "tool_choice")  # the decoder's check: a 400 before local $defs were hoisted
    jsonschema.validate([{"name": "save_person", "arguments": PERSON}], schema)
    with pytest.raises(jsonschema.ValidationError):  # the nested model is still enforced
        jsonschema.validate([{"name": "save_person", "arguments": {**PERSON, "home": {"city": "Oslo"}}}], schema)
    assert tools == before  # the chat template still gets the tools as sent


def test_same_definition_name_in_two_tools_stays_apart():
    other = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
             "$defs": {"Address": {"type": "string", "maxLength": 20}}}
    schema = required([tool("save_person", Person.model_json_schema()), tool("send", other)])
    prepare_schema(schema, "tool_choice")
    assert len(schema["$defs"]) == 2
    jsonschema.validate([{"name": "save_person", "arguments": PERSON}, {"name": "send", "arguments": {"to": "Ada"}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):  # send's Address is a string, not save_person's object
        jsonschema.validate([{"name": "send", "arguments": {"to": PERSON["home"]}}], schema)


def test_recursive_model_and_older_definitions_keyword():
    legacy = {"type": "object", "properties": {"p": {"$ref": "#/definitions/Point"}},
              "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                        "required": ["x"]}}}
    schema = required([tool("tree", Node.model_json_schema()), tool("plot", legacy)])
    prepare_schema(schema, "tool_choice")
    tree = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
    jsonschema.validate([{"name": "tree", "arguments": tree}, {"name": "plot", "arguments": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "tree", "arguments": {"label": "a", "children": [{"children": []}]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plot", "arguments": {"p": {"x": "1"}}}], schema)


def test_root_self_reference_is_hoisted_too():
    linked = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["v"]}
    schema = required([tool("chain", linked)])
    prepare_schema(schema, "tool_choice")
    jsonschema.validate([{"name": "chain", "arguments": {"v": 1, "next": {"v": 2}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "chain", "arguments": {"v": 1, "next": {"v": "x"}}}], schema)


def test_named_function_keeps_its_definitions():
    plan = plan_tools([tool("save_person", Person.model_json_schema())],
                      {"type": "function", "function": {"name": "save_person"}}, None,
                      auto_enabled=False, tool_parser=None)
    prepare_schema(plan.schema, "tool_choice")
    jsonschema.validate(PERSON, plan.schema)
