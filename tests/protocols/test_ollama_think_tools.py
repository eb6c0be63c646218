"""Thinking and tools through the ``ollama`` client on the real SmolLM2, on a server with a
reasoning parser and a tool parser (``--reasoning-parser deepseek_r1 --enable-auto-tool-choice
--tool-call-parser hermes``).

SmolLM2 never writes ``</think>``, so under deepseek_r1 (which reads output without the end
tag as all thinking) everything it says with ``think`` on is ``thinking``; with ``think``
false the parser is off and it is ``content``. The tiny model does not call tools by itself:
the parsing of calls is tested on the echo backend (test_ollama_shapes.py); here the tool
results of a round trip go back to the real model's chat template.
"""

from __future__ import annotations

import ollama
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 10}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client():
    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--log-level",
                           "warning", "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--protocols", "ollama,ops")
    try:
        yield ollama.Client(host=server.wait_ready(timeout=300).url, timeout=300)
    finally:
        server.stop()


def test_show_lists_thinking_and_tools(client):
    assert client.show(MODEL).capabilities == ["completion", "tools", "thinking"]


def test_think_on_and_off(client):
    on = client.chat(model=MODEL, messages=QUESTION, think=True, options=GREEDY)
    assert "Paris" in on.message.thinking and on.message.content == ""
    off = client.chat(model=MODEL, messages=QUESTION, think=False, options=GREEDY)
    assert "Paris" in off.message.content and off.message.thinking is None
    assert on.message.thinking.strip() == off.message.content.strip()  # same greedy words, told apart by think
    level = list(client.generate(model=MODEL, prompt="What is the capital of France?", think="low",
                                 options=GREEDY, stream=True))
    assert "Paris" in "".join(p.thinking or "" for p in level) and not "".join(p.response for p in level)
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=QUESTION, think="extreme")
    assert info.value.status_code == 400 and "invalid think value" in info.value.error


def test_tool_round_trip_reaches_the_template(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat(model=MODEL, messages=asked, tools=TOOLS, think=False, options=GREEDY)
    assert first.done and first.message.role == "assistant"  # tools offered; the model answers in text
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = asked + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_name": "get_weather", "content": "Sunny and 18 degrees Celsius."}]
    answer = client.chat(model=MODEL, messages=history, tools=TOOLS, think=False, options=GREEDY)
    assert answer.done and answer.message.content
    # The call and its result were rendered into the prompt: it grew by at least the result's words.
    assert answer.prompt_eval_count >= first.prompt_eval_count + 8
