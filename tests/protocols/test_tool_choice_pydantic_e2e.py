"""Forced tool calls on the real SmolLM2 through the openai client, with what vLLM's own
OpenAI-server tests send: a tool made from a pydantic model that nests another (its schema uses
local ``$defs``/``$ref``), and a forced call cut off by ``max_tokens``."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Contact(BaseModel):
    name: str = Field(max_length=20)
    home: Address


TOOL = openai.pydantic_function_tool(Contact, name="save_contact", description="Save a contact")
NAMED = {"type": "function", "function": {"name": "save_contact"}}
ASK = [{"role": "user", "content": "Save Ada Lovelace, who lives in London, England."}]


@pytest.fixture(scope="module")
def client(smollm_server):
    deadline = time.time() + 300  # /health answers while the model loads; /ready once it can serve
    while httpx.get(smollm_server.url + "/ready", timeout=5).status_code != 200:
        assert time.time() < deadline, "the server never became ready"
        time.sleep(0.5)
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def streamed(client, **kwargs) -> tuple[list[list[str]], str | None]:
    calls: list[list[str]] = []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                if piece.index == len(calls):
                    calls.append([piece.function.name, piece.function.arguments or ""])
                else:
                    calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_nested_pydantic_tool_is_forced_and_validates(client, tool_choice):
    kwargs = dict(model="", messages=ASK, tools=[TOOL], tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=100, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "save_contact"
    Contact.model_validate_json(call.function.arguments)  # the nested Address included
    calls, finish = streamed(client, **kwargs)
    assert finish == "tool_calls" and calls == [["save_contact", call.function.arguments]]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_cut_by_max_tokens_is_length_without_tool_calls(client, tool_choice):
    kwargs = dict(model="", messages=ASK, tools=[TOOL], tool_choice=tool_choice, max_tokens=6, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    calls, finish = streamed(client, **kwargs)
    assert finish == "length"
    for _, arguments in calls:  # what was sent is what was generated: no closers made up
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)
