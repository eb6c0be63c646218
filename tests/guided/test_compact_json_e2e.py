"""Forced JSON is compact, on the real SmolLM2 through real clients (issue 23, item 1).

Forced tool calls (a named function and ``required``) return arguments with no whitespace
between JSON tokens and end as soon as the value closes (``finish_reason: "tool_calls"``);
``response_format: json_schema`` replies carry no trailing whitespace and finish with
``stop``; LangChain's ``with_structured_output`` gets valid pydantic objects both ways. Before
the fix the arguments were padded with newlines until ``max_tokens`` cut them (LangChain then
returned ``None``) and JSON replies ended with a dozen newlines.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("openai")

pytestmark = pytest.mark.slow

RUNS = 10
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "save_person", "description": "Save a person",
                                           "parameters": PERSON}},
         {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"]}}}]


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20, description="The person's first name")
    age: int = Field(description="Age in years")


def compact(text: str) -> bool:
    """No whitespace outside string literals (and none at either end)."""
    return not re.search(r"\s", STRING.sub('""', text))


def run_all(job, args):
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(job, args))


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_forced_calls_are_compact_and_end_at_once(client, model, tool_choice):
    choice = {"type": "function", "function": {"name": "save_person"}} if tool_choice == "named" else "required"
    budget = 40 if tool_choice == "named" else 64  # the budget; "required" also spells the name

    def job(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Invent a person and save them."}], tools=TOOLS,
            tool_choice=choice, parallel_tool_calls=False, max_tokens=budget, temperature=0.8, seed=seed).choices[0]

    for c in run_all(job, range(RUNS)):
        assert c.finish_reason == "tool_calls", c  # not "length": no padding ate the budget
        (call,) = c.message.tool_calls
        arguments = call.function.arguments
        assert "\n" not in arguments and compact(arguments), arguments
        schema = PERSON if call.function.name == "save_person" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)


def test_json_schema_reply_has_no_trailing_whitespace(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def job(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
            response_format=fmt, max_tokens=60, temperature=0.8, seed=seed)

    for r in run_all(job, range(RUNS)):
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        text = c.message.content
        assert text == text.strip() and compact(text), repr(text)
        jsonschema.validate(json.loads(text), PERSON)


def langchain_model(server, model: str, seed: int):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    # The budget of the report: padded arguments ran into it.
    return chat_openai(base_url=server.url + "/v1", api_key="x", model=model, max_tokens=40, temperature=0.8,
                       seed=seed, max_retries=0, timeout=120)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(smollm_server, model, method):
    def job(seed):
        llm = langchain_model(smollm_server, model, seed)
        return llm.with_structured_output(Person, method=method, include_raw=True).invoke("Invent a person.")

    for out in run_all(job, range(RUNS)):
        assert isinstance(out["parsed"], Person), out  # None when the arguments were cut off
        raw = out["raw"]
        assert raw.response_metadata["finish_reason"] == ("tool_calls" if method == "function_calling" else "stop")
        if method == "json_schema":
            assert raw.content == raw.content.strip() and compact(raw.content), repr(raw.content)


def test_langchain_bind_tools_forced_call(smollm_server, model):
    def job(seed):
        llm = langchain_model(smollm_server, model, seed).bind_tools([Person], tool_choice="Person")
        return llm.invoke("Invent a person.")

    for message in run_all(job, range(RUNS)):
        assert message.response_metadata["finish_reason"] == "tool_calls", message
        (call,) = message.tool_calls
        assert call["name"] == "Person" and Person(**call["args"]), message
