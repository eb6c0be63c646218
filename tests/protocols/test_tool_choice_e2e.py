"""tool_choice "required" and a named function on the real SmolLM2 through the openai client:
guided decoding makes even this small model return calls that parse and validate, in 20 of 20
sampled runs, streamed and not. (The session server has no tool parser flags, so "auto" is a
400 there.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "exact": {"type": "boolean"}},
            "required": ["query"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "Add 17 and 25.", "Find recent news about solar power.",
           "Is it cold in Oslo today?", "What is 3 plus 4?"]
RUNS = 20


@pytest.fixture(scope="module")
def client(smollm_server):
    # Pooled connections are safe to reuse between bursts: test servers keep idle connections
    # open far longer than a test runs (see ServerProcess in conftest.py).
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _request(run: int, tool_choice, stream: bool) -> dict:
    return dict(model="", messages=[{"role": "user", "content": PROMPTS[run % len(PROMPTS)]}], tools=TOOLS,
                tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=120, temperature=1.0,
                seed=1000 + run, stream=stream)


def _collect(client, kwargs: dict) -> tuple[list[tuple[str, str]], str]:
    """(name, arguments) of each call, and the finish reason, from either response kind."""
    if not kwargs["stream"]:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    calls: list[list[str]] = []
    finish = None
    for chunk in client.chat.completions.create(**kwargs):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                if piece.index == len(calls):
                    assert piece.id and piece.function.name
                    calls.append([piece.function.name, piece.function.arguments or ""])
                else:
                    assert piece.id is None and piece.function.name is None
                    calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [tuple(c) for c in calls], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_validate_in_every_run(client, tool_choice):
    jobs = []
    for run in range(RUNS):
        choice = tool_choice
        if tool_choice == "named":
            choice = {"type": "function", "function": {"name": TOOLS[run % len(TOOLS)]["function"]["name"]}}
        for stream in (False, True):
            jobs.append((run, choice, stream))
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: (job, _collect(client, _request(*job))), jobs))
    seen = set()
    for (run, choice, stream), (calls, finish) in results:
        assert finish == "tool_calls", (run, stream, calls)
        assert len(calls) == 1, (run, stream, calls)  # parallel_tool_calls false
        name, arguments = calls[0]
        if isinstance(choice, dict):
            assert name == choice["function"]["name"]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        seen.add(arguments)
    assert len(seen) > 5  # sampled runs differ: this is not one cached answer


def test_auto_without_server_flags_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice="auto", max_tokens=5)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in body["message"]
