"""Responses on the echo backend, through the ``openai`` SDK: the "model" says back the last
message, so each test writes the output it needs (reasoning, tool calls in a parser's format)
and checks the items and events the server makes of it. Also the store's bounds, and turning
the dialect off.
"""

from __future__ import annotations

import json

import openai

from llmserve.plugins.protocols.responses.store import ResponseStore

LAST_MESSAGE = "{{ messages[-1].content }}"
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
CALL_W = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
CALL_A = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def sdk(echo_app, **flags):
    client, context = echo_app(**flags)
    context.engine.tokenizer.chat_template = LAST_MESSAGE  # the echo model has no template of its own
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def stream(client, **kwargs):
    with client.responses.stream(**kwargs) as s:
        events = list(s)
        return events, s.get_final_response()


def test_reasoning_items_and_events(echo_app):
    client = sdk(echo_app, reasoning_parser="deepseek_r1")
    said = "Let me think.</think>The answer is 4."
    r = client.responses.create(model="echo", input=said, reasoning={"effort": "low"})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "Let me think." and reasoning.summary == []
    assert message.type == "message" and r.output_text == "The answer is 4."
    assert r.reasoning.effort == "low" and r.usage.output_tokens_details.reasoning_tokens == len("Let me think.")
    events, final = stream(client, model="echo", input=said)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    i = kinds.index("response.reasoning_text.done")
    assert kinds[i:i + 5] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done", "response.output_item.added",
                              "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me think."
    assert [e.output_index for e in events if e.type == "response.output_text.delta"][0] == 1
    assert [(o.type, o.model_dump(exclude={"id"}, exclude_none=True)) for o in final.output] == \
        [(o.type, o.model_dump(exclude={"id"}, exclude_none=True)) for o in r.output]


def test_reasoning_history_is_accepted(echo_app):
    client = sdk(echo_app, reasoning_parser="deepseek_r1")
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "ok</think>done"}]
    assert client.responses.create(model="echo", input=items).output_text == "done"


def test_auto_tool_calls_become_function_call_items(echo_app):
    client = sdk(echo_app, enable_auto_tool_choice=True, tool_call_parser="hermes")
    said = f"Checking.\n{CALL_W}\n{CALL_A}"
    r = client.responses.create(model="echo", input=said, tools=TOOLS)
    message, weather, add = r.output
    assert message.type == "message" and r.output_text.strip() == "Checking."
    assert (weather.type, weather.name, json.loads(weather.arguments)) == ("function_call", "get_weather",
                                                                           {"city": "Zürich"})
    assert (add.name, json.loads(add.arguments)) == ("add", {"a": 1, "b": 2})
    assert weather.call_id != add.call_id and weather.status == add.status == "completed"
    events, final = stream(client, model="echo", input=said, tools=TOOLS)
    for index, call in ((1, weather), (2, add)):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        done = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert "".join(pieces) == done[0].arguments == final.output[index].arguments
        assert json.loads(final.output[index].arguments) == json.loads(call.arguments)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    one = client.responses.create(model="echo", input=said, tools=TOOLS, parallel_tool_calls=False)
    assert [o.type for o in one.output] == ["message", "function_call"] and one.parallel_tool_calls is False
    # Only whitespace before a call opens no message item
    only = client.responses.create(model="echo", input="\n" + CALL_A, tools=TOOLS)
    assert [o.type for o in only.output] == ["function_call"]


def test_disabled_with_protocols_flag(echo_app):
    client, _ = echo_app(protocols=["openai"])
    assert client.post("/v1/responses", json={"input": "hi"}).status_code == 404
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "disable_chat_template": True}).status_code == 200


def test_store_bounds_by_count_and_bytes():
    store = ResponseStore(max_responses=3, max_bytes=2000)
    big = "x" * 800
    for i in range(3):
        assert store.put("a", {"id": f"r{i}", "t": big}, [])
    count, size = store.usage("a")
    assert count == 2 and size <= 2000  # the third did not fit beside two: the oldest went
    assert store.get("a", "r0") is None and store.get("a", "r2") is not None
    assert store.get("b", "r2") is None  # another owner sees nothing
    assert not store.put("a", {"id": "huge", "t": "x" * 3000}, [])  # alone over the bound: not kept
    assert store.get("a", "huge") is None
    for i in range(5):
        store.put("b", {"id": f"s{i}"}, [])
    assert store.usage("b")[0] == 3 and store.get("b", "s0") is None and store.get("b", "s4") is not None
    store.get("b", "s2")  # recently used: survives the next eviction
    store.put("b", {"id": "s5"}, [])
    assert store.get("b", "s2") is not None and store.get("b", "s3") is None
    assert store.delete("b", "s2") and not store.delete("b", "s2")
    assert store.usage("a")[0] == 2  # owners do not share a budget
    assert ResponseStore.owner("k") != "k" and ResponseStore.owner(None) == ""


def test_an_error_after_the_200_is_an_error_event(echo_app, monkeypatch):
    monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "request:doomed")  # post-processing of that request raises
    client, context = echo_app()
    context.engine.tokenizer.chat_template = LAST_MESSAGE
    r = client.post("/v1/responses", json={"input": "hi", "stream": True}, headers={"x-request-id": "doomed-1"})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2]
    assert events[-1]["code"] == "generation_error" and "see the server log" in events[-1]["message"]
    whole = client.post("/v1/responses", json={"input": "hi"}, headers={"x-request-id": "doomed-2"})
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "generation_error"
    fine = client.post("/v1/responses", json={"input": "still fine"})
    assert fine.status_code == 200 and fine.json()["output"][0]["content"][0]["text"] == "still fine"


def test_auto_tool_choice_without_tools_is_plain_text(echo_app):
    client = sdk(echo_app)
    r = client.responses.create(model="echo", input="plain", tool_choice="auto", tools=[])
    assert r.output_text == "plain" and r.tool_choice == "auto"


NAMESPACED = [{"type": "namespace", "name": "files", "description": "The project's files", "tools": [
    {"type": "function", "name": "read",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
    {"type": "web_search"}]  # a hosted tool: only OpenAI's servers run it


def test_namespace_tools_are_offered_flat_and_called_back_with_their_namespace(echo_app, caplog):
    """Codex sends its MCP tools as a ``namespace`` tool and a hosted ``web_search`` beside them:
    the model sees ``files__read``, the call comes back as ``read`` in namespace ``files`` (whole
    and streamed), the hosted tool is left out with a warning, and the call goes back in history."""
    client, context = echo_app(enable_auto_tool_choice=True, tool_call_parser="hermes")
    context.engine.tokenizer.chat_template = LAST_MESSAGE
    said = '<tool_call>{"name": "files__read", "arguments": {"path": "a.txt"}}</tool_call>'
    with caplog.at_level("WARNING", logger="llmserve.responses"):
        r = client.post("/v1/responses", json={"model": "echo", "input": said, "tools": NAMESPACED})
    assert r.status_code == 200, r.text
    call = r.json()["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "read", "files")
    assert json.loads(call["arguments"]) == {"path": "a.txt"}
    assert "web_search" in caplog.text
    streamed = client.post("/v1/responses", json={"model": "echo", "input": said, "tools": NAMESPACED,
                                                   "stream": True}).text
    added = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    items = [e["item"] for e in added if e["type"] == "response.output_item.added"]
    assert items[0]["name"] == "read" and items[0]["namespace"] == "files"
    history = [{"type": "function_call", "call_id": "c1", "name": "read", "namespace": "files",
                "arguments": '{"path": "a.txt"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "hello"}]
    again = client.post("/v1/responses", json={"model": "echo", "input": history, "tools": NAMESPACED})
    assert again.status_code == 200, again.text
    bad = client.post("/v1/responses", json={"model": "echo", "input": said,
                                             "tools": [{"type": "namespace", "name": "files", "tools": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0", bad.text
