"""The Anthropic Messages dialect end to end: the real ``anthropic`` SDK against the real SmolLM2
server (session fixture ``smollm_server``): create streamed and not, the ``messages.stream``
helper, system prompts, stop sequences, forced tools whose input validates against the schema,
a tool_result round trip, count_tokens, structured output and typed errors. Greedy decoding
and short replies (max_tokens <= 60)."""

from __future__ import annotations

import json

import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def client(smollm_server):
    return anthropic.Anthropic(base_url=smollm_server.url, api_key="unused", max_retries=0, timeout=300)


def create(client, **kwargs):
    args = {"model": "smollm2", "max_tokens": 24, "messages": QUESTION, "extra_body": GREEDY}
    return client.messages.create(**{**args, **kwargs})


def test_create_not_streamed(client):
    msg = create(client)
    assert isinstance(msg, anthropic.types.Message)
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.type == "message"
    assert msg.model == "SmolLM2-135M-Instruct"  # one served name: any name is answered under it
    assert len(msg.content) == 1 and msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10
    assert 0 < msg.usage.output_tokens <= 24


def test_create_streamed_matches_not_streamed(client):
    whole = create(client)
    stream = create(client, stream=True)
    kinds, text = [], ""
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == "content_block_delta":
            assert ev.delta.type == "text_delta"
            text += ev.delta.text
        if ev.type == "message_delta":
            assert ev.delta.stop_reason == whole.stop_reason
            assert ev.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert text == whole.content[0].text


def test_message_start_reports_the_cached_prefix(client):
    create(client)  # its prompt's full blocks are now in the prefix cache
    events = list(create(client, stream=True))
    start, delta = events[0].message.usage, next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens > 0 and start.cache_read_input_tokens % 16 == 0
    assert start.cache_read_input_tokens == delta.cache_read_input_tokens
    assert start.input_tokens + start.cache_read_input_tokens == delta.input_tokens + delta.cache_read_input_tokens


def test_stream_helper(client):
    whole = create(client)
    with client.messages.stream(model="m", max_tokens=24, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_system_prompt(client):
    def count(system):
        return client.messages.count_tokens(model="m", messages=QUESTION, system=system).input_tokens

    system = "You are a pirate. Answer in one short sentence."
    with_system = count(system)
    assert count(system + " Never use the letter e in any of your answers.") > with_system
    assert count([{"type": "text", "text": system}]) == with_system
    msg = create(client, system=system)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == with_system
    assert msg.content[0].text != create(client).content[0].text


def test_stop_sequences(client):
    text = create(client, max_tokens=40).content[0].text
    words = [w for w in text.split() if len(w) > 3]
    stop = words[1] if len(words) > 1 else words[0]
    for stream in (False, True):
        if stream:
            with client.messages.stream(model="m", max_tokens=40, messages=QUESTION, stop_sequences=[stop],
                                        extra_body=GREEDY) as s:
                msg = s.get_final_message()
        else:
            msg = create(client, max_tokens=40, stop_sequences=["never here", stop])
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
        assert msg.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_input_validates(client, stream):
    for city_prompt in ("What is the weather in Paris?", "Is it cold in Oslo?", "Weather in Lima, please."):
        kwargs = dict(model="m", max_tokens=60, tools=[WEATHER, ADD],
                      tool_choice={"type": "tool", "name": "get_weather"},
                      messages=[{"role": "user", "content": city_prompt}], extra_body=GREEDY)
        if stream:
            with client.messages.stream(**kwargs) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**kwargs)
        assert msg.stop_reason == "tool_use"
        (call,) = msg.content
        assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER["input_schema"])


def test_tool_choice_any_picks_a_tool_and_validates(client):
    msg = client.messages.create(model="m", max_tokens=60, tools=[WEATHER, ADD], messages=[
        {"role": "user", "content": "Add 17 and 25."}], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY)
    assert msg.stop_reason == "tool_use" and len(msg.content) == 1
    call = msg.content[0]
    jsonschema.validate(call.input, {"get_weather": WEATHER, "add": ADD}[call.name]["input_schema"])


def test_tool_result_round_trip(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(model="m", max_tokens=60, tools=[WEATHER], messages=[question],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    call = first.content[0]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "It is 21 degrees and sunny in Paris."}]}
    history = [question, first.to_param(), result]
    second = client.messages.create(model="m", max_tokens=30, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=history, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    counted = client.messages.count_tokens(model="m", messages=history, tools=[WEATHER],
                                           tool_choice={"type": "none"}).input_tokens
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) == counted
    shorter = [question, first.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}]}]
    assert client.messages.count_tokens(model="m", messages=shorter).input_tokens < counted
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        client.messages.create(model="m", max_tokens=5, messages=[question, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "x"}]}])


def test_count_tokens_matches_usage(client):
    counted = client.messages.count_tokens(model="m", messages=QUESTION)
    assert counted.input_tokens > 10
    msg = create(client, max_tokens=2)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=QUESTION, tools=[WEATHER]).input_tokens
    assert with_tools >= counted.input_tokens  # tools go through the template (SmolLM2's ignores them)


def test_output_config_format_gives_valid_json(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 20},
                                               "count": {"type": "integer"}},
              "required": ["color", "count"], "additionalProperties": False}
    msg = create(client, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_beta_client_and_headers(client):
    msg = client.beta.messages.create(model="m", max_tokens=8, messages=QUESTION, betas=["output-128k-2025-02-19"],
                                      extra_body=GREEDY)
    assert msg.content[0].text == create(client, max_tokens=8).content[0].text


def test_errors_are_typed_sdk_exceptions(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert info.value.status_code == 400 and "image" in info.value.message
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="m", messages=QUESTION, max_tokens=anthropic.omit)
    with pytest.raises(anthropic.BadRequestError, match="enable-auto-tool-choice"):
        create(client, tools=[WEATHER])
    with pytest.raises(anthropic.BadRequestError, match="output_config.grammar"):
        create(client, output_config={"grammar": "root ::= x"})
