"""Enforced thinking budgets through the real clients of every dialect that carries one: OpenAI
chat (``thinking_budget``, ``reasoning_effort``), Responses (``reasoning.effort``), Anthropic
(``thinking.budget_tokens``) and Ollama (``think`` levels), streamed and whole.

The server runs the generated model of ``tests/thinking_model.py``, whose reasoning never ends
(its template opens ``<think>``, and it never writes ``</think>``), under ``--reasoning-parser
deepseek_r1`` with ``low`` mapped to 32 tokens. Its vocabulary is one word per token, so the
reasoning's word count is its token count. Greedy decoding: streamed and whole replies agree.
"""

from __future__ import annotations

import pytest

from conftest import ServerProcess
from thinking_model import END_ID, build_thinking_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

QUESTION = [{"role": "user", "content": "w1 w2 w3"}]
LOW = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_thinking_model(str(tmp_path_factory.mktemp("thinker")))
    proc = ServerProcess(path, "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                         "--reasoning-parser", "deepseek_r1", "--reasoning-effort-budgets", f"low={LOW}",
                         "--served-model-name", "thinker", "--log-level", "warning")
    try:
        yield proc.wait_ready(timeout=300)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def words(text: str | None) -> int:
    return len((text or "").split())


# -- OpenAI chat --------------------------------------------------------------------------------
def chat(oai, stream: bool = False, **extra):
    args = {"model": "thinker", "messages": QUESTION, "temperature": 0, "max_tokens": 100}
    if not stream:
        r = oai.chat.completions.create(**args, extra_body={**extra, "return_token_ids": True})
        m = r.choices[0].message
        return m.reasoning_content, m.content, r.usage.completion_tokens_details.reasoning_tokens, \
            r.choices[0].token_ids
    reasoning, content, usage = "", "", None
    for chunk in oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True},
                                             extra_body=extra):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
        usage = chunk.usage or usage
    return reasoning or None, content, usage.completion_tokens_details.reasoning_tokens, None


def test_without_a_budget_the_reasoning_never_ends(oai):
    reasoning, content, spent, ids = chat(oai)
    assert words(reasoning) == 100 and not content and END_ID not in ids
    assert spent == 100  # no budget: the reasoning text, re-tokenized


@pytest.mark.parametrize("extra, budget", [({"thinking_budget": 64}, 64), ({"reasoning_effort": "low"}, LOW),
                                           ({"reasoning_effort": "none"}, 0), ({"thinking_budget": 1}, 1),
                                           ({"thinking_budget": 5, "reasoning_effort": "low"}, 5)])
def test_openai_chat_budget_streamed_and_whole(oai, extra, budget):
    reasoning, content, spent, ids = chat(oai, **extra)
    assert ids[budget] == END_ID and ids.count(END_ID) == 1  # forced right where the budget ran out
    assert words(reasoning) == spent == budget and content.strip()
    assert chat(oai, stream=True, **extra)[:3] == (reasoning, content, spent)


def test_openai_chat_invalid_budgets_are_openai_400s(oai):
    for extra, param in [({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"thinking_budget": -1}, None),
                         ({"thinking_budget": "many"}, None)]:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="thinker", messages=QUESTION, max_tokens=5, extra_body=extra)
        assert info.value.status_code == 400
        assert "thinking_budget" in str(info.value) if param is None else info.value.param == param


# -- Responses ---------------------------------------------------------------------------------
def test_responses_effort_streamed_and_whole(oai):
    args = {"model": "thinker", "input": "w1 w2 w3", "temperature": 0, "max_output_tokens": 80,
            "reasoning": {"effort": "low"}}
    whole = oai.responses.create(**args)
    reasoning = next(item for item in whole.output if item.type == "reasoning").content[0].text
    assert words(reasoning) == LOW == whole.usage.output_tokens_details.reasoning_tokens
    assert whole.output_text.strip()
    ends = ("response.completed", "response.incomplete")  # incomplete: max_output_tokens ended the answer
    final = [ev.response for ev in oai.responses.create(**args, stream=True) if ev.type in ends][0]
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in whole.output]
    assert final.usage.output_tokens_details.reasoning_tokens == LOW
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**{**args, "reasoning": {"effort": "extreme"}})
    assert info.value.param == "reasoning.effort"


# -- Anthropic ---------------------------------------------------------------------------------
def test_anthropic_budget_tokens_streamed_and_whole(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    args = {"model": "thinker", "max_tokens": 100, "messages": QUESTION, "extra_body": {"temperature": 0},
            "thinking": {"type": "enabled", "budget_tokens": 64}}
    msg = client.messages.create(**args)
    thinking, text = msg.content[0], msg.content[1]
    assert thinking.type == "thinking" and words(thinking.thinking) == 64
    assert text.type == "text" and text.text.strip() and msg.usage.output_tokens == 100
    streamed = {"thinking": "", "text": ""}
    with client.messages.stream(**args) as stream:
        for ev in stream:
            if ev.type == "content_block_delta" and ev.delta.type in ("thinking_delta", "text_delta"):
                key = ev.delta.type.removesuffix("_delta")
                streamed[key] += getattr(ev.delta, key)
    assert streamed == {"thinking": thinking.thinking, "text": text.text}
    for thinking_param, param in [({"type": "enabled", "budget_tokens": 0}, None),
                                  ({"type": "enabled", "budget_tokens": 100}, "max_tokens")]:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**{**args, "thinking": thinking_param})
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert param is None or param in info.value.body["error"]["message"]


# -- Ollama ------------------------------------------------------------------------------------
def test_ollama_think_level_streamed_and_whole(server):
    client = ollama.Client(host=server.url, timeout=120)
    options = {"temperature": 0, "num_predict": 80}
    whole = client.chat(model="thinker", messages=QUESTION, think="low", options=options)
    assert words(whole.message.thinking) == LOW and whole.message.content.strip()
    parts = list(client.chat(model="thinker", messages=QUESTION, think="low", options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == whole.message.content
    on = client.chat(model="thinker", messages=QUESTION, think=True, options=options)  # no level: no budget
    assert words(on.message.thinking) == 80 and not on.message.content
    generated = client.generate(model="thinker", prompt="w1 w2", think="low", options=options)
    assert words(generated.thinking) == LOW and generated.response.strip()
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="thinker", messages=QUESTION, think="extreme")
    assert info.value.status_code == 400 and "invalid think value" in info.value.error
