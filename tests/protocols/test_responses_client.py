"""The official ``openai`` SDK's ``responses`` API against the real embedded SmolLM2 (the session
server: stateless, no tool-parser flags).

Greedy output (temperature 0) is deterministic, so a Responses request is compared with the
chat completion of the same conversation, and a streamed response with a non-streamed one,
rather than with hard-coded text. Forced calls and ``text.format`` are sampled several times and
must validate every time.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD, "strict": True}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"},  # bounds are not enforced (guided-decoding.md)
                                           "pets": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(smollm_server):
    return smollm_server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(client):
    return client.models.list().data[0].id


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage.prompt_tokens


# -- create ------------------------------------------------------------------------------------
def test_string_input_is_a_user_message(client, served):
    r = client.responses.create(model="m", input="What is the capital of France?", temperature=0,
                                max_output_tokens=16)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.model == served and r.store is False  # the session server keeps no responses
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text
    text, prompt_tokens = chat_text(client, [{"role": "user", "content": "What is the capital of France?"}], 16)
    assert r.output_text == text and "Paris" in text
    u = r.usage
    assert u.input_tokens == prompt_tokens and 0 < u.output_tokens <= 16
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0


def test_item_list_with_parts_and_history_matches_chat(client):
    items = [{"role": "system", "content": "You are a terse assistant."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Name a fruit."}]
    r = client.responses.create(model="m", input=items, temperature=0, max_output_tokens=12)
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Name a fruit."}]
    text, prompt_tokens = chat_text(client, messages, 12)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens


def test_instructions_are_a_system_message_and_developer_is_system(client):
    question = "Tell me about the sea."
    r = client.responses.create(model="m", instructions="Answer like a pirate.", input=question, temperature=0,
                                max_output_tokens=16)
    assert r.instructions == "Answer like a pirate."
    as_developer = client.responses.create(model="m", temperature=0, max_output_tokens=16, input=[
        {"role": "developer", "content": "Answer like a pirate."}, {"role": "user", "content": question}])
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Answer like a pirate."},
                                             {"role": "user", "content": question}], 16)
    assert r.output_text == as_developer.output_text == text
    assert r.usage.input_tokens == as_developer.usage.input_tokens == prompt_tokens


def test_function_call_history_round_trip_matches_chat(client):
    args = '{"city": "Paris", "unit": "celsius"}'
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}]
    r = client.responses.create(model="m", input=items, temperature=0, max_output_tokens=20)
    assert r.status == "completed" and r.output[0].type == "message"
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 21}'}]
    text, prompt_tokens = chat_text(client, messages, 20)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_parse_and_validate(client, tool_choice):
    prompts = ["What is the weather in Oslo?", "Add 2 and 40.", "Is it warm in Rome?", "What is 7 plus 8?"]

    def one(run):
        choice = tool_choice if tool_choice == "required" else {"type": "function", "name": TOOLS[run % 2]["name"]}
        r = client.responses.create(model="m", input=prompts[run % 4], tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=80)
        return choice, r

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for choice, r in results:
        assert r.status == "completed", r
        [call] = r.output
        assert call.type == "function_call" and call.status == "completed" and call.call_id.startswith("call_")
        if isinstance(choice, dict):
            assert call.name == choice["name"]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == choice["name"]


def test_allowed_tools_narrows_a_required_choice(client):
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]}
    for prompt in ("What is the weather in Oslo?", "Is it raining in Lima?"):
        r = client.responses.create(model="m", input=prompt, tools=TOOLS, tool_choice=choice, temperature=0,
                                    max_output_tokens=60)
        assert r.output and {(o.type, o.name) for o in r.output} == {("function_call", "add")}
        for call in r.output:
            jsonschema.validate(json.loads(call.arguments), ADD)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="x", tools=TOOLS, tool_choice={**choice, "tools": [
            {"type": "function", "name": "nope"}]})
    assert err.value.body["param"] == "tool_choice"


def test_text_format_json_schema_is_valid_json(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}

    def one(run):
        return client.responses.create(model="m", input=f"Describe person number {run}.", text={"format": fmt},
                                       temperature=1.0, max_output_tokens=120)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for r in results:
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    obj = client.responses.create(model="m", input="Any JSON object.", text={"format": {"type": "json_object"}},
                                  temperature=0, max_output_tokens=60)
    assert isinstance(json.loads(obj.output_text), dict)


# -- streaming ---------------------------------------------------------------------------------
def test_stream_event_sequence_and_final_response(client):
    args = dict(model="m", input="Say hello to the world.", temperature=0, max_output_tokens=40)
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[5:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == final.output_text
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.id == events[0].response.id and final.usage.output_tokens > 0
    whole = client.responses.create(**args)
    assert whole.output_text == final.output_text and whole.usage.output_tokens == final.usage.output_tokens


def test_stream_forced_call_arguments(client):
    with client.responses.stream(model="m", input="Weather in Lima?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    [call] = final.output
    assert streamed == done.arguments == call.arguments and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_logprobs_of_the_answer_streamed_and_not(client):
    args = dict(model="m", input="Name a color.", temperature=0, max_output_tokens=8,
                include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**args)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode())
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert lp.top_logprobs[0].logprob >= lp.logprob - 1e-4  # greedy: the token taken is the best one
    with client.responses.stream(**args) as stream:
        events = list(stream)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in done.logprobs]
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    # Without include (and top_logprobs), none come back.
    plain = client.responses.create(**{k: v for k, v in args.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs == []


def test_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="m", input="Count from one to one hundred.", temperature=0,
                                max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 4
    with client.responses.stream(model="m", input="Count from one to one hundred.", temperature=0,
                                 max_output_tokens=4) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == r.output_text


# -- errors ------------------------------------------------------------------------------------
BAD = [
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "hi", "tools": [{"type": 7}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]}]},
     "tools.0.tools.0"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS}, "tool_choice"),  # auto needs the server's tool-parser flags
    ({"input": "hi", "text": {"format": {"type": "regex", "pattern": "a+"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "guided_json": {"type": "object"}}, "guided_json"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({}, "input"),
    ({"input": 5}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(url, body, param):
    r = httpx.post(url + "/v1/responses", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    assert error["message"] and error["type"] == "invalid_request_error"


def test_unknown_ids_are_404_in_openai_envelope(client, url):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id" and "resp_nope" in err.value.body["message"]
    for method in ("GET", "DELETE"):
        r = httpx.request(method, url + "/v1/responses/resp_nope", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # store: true on a stateless server is answered, with store false in the reply
    r = client.responses.create(model="m", input="hi", store=True, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
