"""What vLLM's OpenAI server answers and llmserve now answers alike, on the echo backend (the
"model" says the last user message back, byte by byte, so each test writes the output it needs):

- reasoning under ``reasoning`` (vLLM's current name) and ``reasoning_content`` (the older one),
  in the message and in every delta; ``include_reasoning: false`` drops it;
- ``usage.completion_tokens_details.reasoning_tokens``;
- ``stream_options.continuous_usage_stats``: the role-only first chunk counts no completion token;
- a forced tool call cut off by ``max_tokens``: ``finish_reason: "length"`` and no ``tool_calls``.
"""

from __future__ import annotations


import pytest

from .test_openai_shapes import sse_events

THOUGHT, ANSWER = "Paris is in France.", "The capital is Paris."
SAID = f"<think>{THOUGHT}</think>{ANSWER}"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
NAMED = {"type": "function", "function": {"name": "add"}}


def chat(client, said: str, stream: bool = False, **extra):
    body = {"messages": [{"role": "user", "content": said}], "disable_chat_template": True,
            "stream": stream, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return sse_events(r.text) if stream else r.json()


@pytest.fixture
def thinking(echo_app):
    client, _ = echo_app(reasoning_parser="deepseek_r1")
    return client


def test_reasoning_under_both_names_in_message_and_deltas(thinking):
    msg = chat(thinking, SAID)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT, "reasoning_content": THOUGHT}
    deltas = [c["delta"] for e in chat(thinking, SAID, stream=True) for c in e["choices"]]
    pieces = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert pieces and all(d["reasoning"] == d["reasoning_content"] for d in pieces)
    assert "".join(d["reasoning"] for d in pieces) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_include_reasoning_false_drops_the_reasoning(thinking):
    body = chat(thinking, SAID, include_reasoning=False)
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ANSWER, "reasoning": None, "reasoning_content": None}
    # the thinking was still generated: usage counts it
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT.encode())}
    deltas = [c["delta"] for e in chat(thinking, SAID, stream=True, include_reasoning=False) for c in e["choices"]]
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_reasoning_tokens_in_usage_streamed_and_not(thinking, echo_app):
    # The echo tokenizer is one token per byte: the thinking is exactly its bytes.
    expected = len(THOUGHT.encode())
    usage = chat(thinking, SAID)["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}
    assert usage["completion_tokens"] == len(SAID.encode()) + 1  # + end of sequence
    events = chat(thinking, SAID, stream=True, stream_options={"include_usage": True})
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    plain, _ = echo_app()  # no reasoning parser: nothing is reasoning
    assert chat(plain, SAID)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_continuous_usage_first_chunk_counts_no_completion_token(echo_app):
    client, _ = echo_app()
    events = chat(client, "hello there", stream=True, max_tokens=6,
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    first = events[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"]["completion_tokens"] == 0
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] == len(b"hello there")
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[1] == 1 and counts[-1] == 6


@pytest.mark.parametrize("choice, said, max_tokens", [
    ("required", '[{"name":"add","arguments":{"a":1,"b":2}}]', 30),
    ("required", '[{"name":"add","arguments":{"a":1,"b":2}}]', 3),
    (NAMED, '{"a":1,"b":2}', 6),
    (NAMED, '{"a":1,"b":2}', 1),
])
def test_forced_call_cut_by_max_tokens_is_length_without_tool_calls(echo_app, choice, said, max_tokens):
    client, _ = echo_app()
    reply = chat(client, said, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens)["choices"][0]
    assert reply["finish_reason"] == "length"
    assert "tool_calls" not in reply["message"]
    assert reply["message"]["content"] == ""
    # Streamed, the fragments already sent stay sent; the end adds no made-up closers or empty
    # call, and says "length".
    events = chat(client, said, stream=True, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens)
    pieces = [p for e in events for c in e["choices"] for p in c["delta"].get("tool_calls") or []]
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    assert '{"a":1,"b":2}'.startswith(arguments) and arguments != '{"a":1,"b":2}'
    assert all(p["function"]["name"] == "add" for p in pieces if "id" in p)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_forced_call_that_completes_is_unchanged(echo_app):
    client, _ = echo_app()
    reply = chat(client, '{"a":1,"b":2}', tools=TOOLS, tool_choice=NAMED, max_tokens=50)["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    assert [c["function"] for c in reply["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a":1,"b":2}'}]
