"""A Claude Code session replayed against the Anthropic dialect on the echo backend: the request
shapes the CLI sends (a per-request billing block first in ``system``, a long system prompt and
tool schemas, ``max_tokens`` 32000, a growing history with tool round trips). Turn 2 and later
must prefill only their new tokens: the rest of the prompt comes from the prefix cache, which
the billing block's nonce would defeat if it reached the prompt (``anthropic: {billing_header:
keep}`` shows that). The echo backend reads what it says back from the KV slots, so a wrong
cache hit would show as a wrong reply too."""

from __future__ import annotations

import json

import pytest

BLOCK = 16
# System first, the tools after it (where Qwen's and Llama's templates put them), then the turns.
TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
            "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n"
            "{% if loop.first and tools %}<|tools|>{{ tools | tojson }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = ("You are an interactive CLI tool that helps users with software engineering tasks. "
          "Use the instructions below and the tools available to you to assist the user. ") * 8
TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: reads, edits or runs things in the workspace.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
         for i in range(10)]


def system(nonce: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.e4f; cc_entrypoint=cli; "
                                     f"cch={nonce};"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]


def turns() -> list[list[dict]]:
    """The history each of three requests sends: a question, a tool call and its result, a follow-up."""
    first = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Today is a workday.</system-reminder>"},
        {"type": "text", "text": "Which files are in src/?"}]}]
    second = first + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "tool_3",
                                           "input": {"path": "src/"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": "main.py\nutil.py\nREADME.md"}]}]
    third = second + [
        {"role": "assistant", "content": [{"type": "text", "text": "src/ holds main.py, util.py and README.md."}]},
        {"role": "user", "content": [{"type": "text", "text": "Open util.py."}]}]
    return [first, second, third]


@pytest.fixture
def session(echo_app):
    def start(**options):
        client, context = echo_app(max_model_len=4608, block_size=BLOCK, enable_auto_tool_choice=True,
                                   tool_call_parser="hermes", **options)
        context.model.tokenizer.chat_template = TEMPLATE
        return client

    return start


def replay(client) -> list[dict]:
    usages = []
    for n, messages in enumerate(turns()):
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "system": system(f"{n:05x}a9"),
                "messages": messages, "tools": TOOLS, "metadata": {"user_id": "user_1"}, "stream": n == 2}
        r = client.post("/v1/messages?beta=true", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200, r.text
        if n == 2:  # the CLI streams: message_start carries the cached count, message_delta the rest
            frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            start = frames[0]["message"]["usage"]
            final = next(f for f in frames if f["type"] == "message_delta")["usage"]
            assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]
            usages.append(final)
        else:
            reply = r.json()
            # 32000 was capped to the room the prompt leaves, not refused; the reply ran into it.
            assert reply["stop_reason"] == "model_context_window_exceeded"
            said = reply["content"][0]["text"]  # the prompt, read back from the KV slots
            assert said.startswith("<|system|>") and "You are Claude Code" in said[:200]
            usages.append(reply["usage"])
    return usages


def test_turns_after_the_first_prefill_only_their_new_tokens(session):
    usages = replay(session())
    prompts = [u["input_tokens"] + u["cache_read_input_tokens"] for u in usages]
    assert prompts[0] > 2000 and prompts[0] < prompts[1] < prompts[2]
    for n in (1, 2):
        new = prompts[n] - prompts[n - 1]
        # Everything the earlier turn's prompt held in full blocks is read back; at most its last
        # partial block and the new tokens are prefilled.
        assert usages[n]["cache_read_input_tokens"] >= prompts[n - 1] // BLOCK * BLOCK - BLOCK, (n, usages)
        assert usages[n]["input_tokens"] <= new + 2 * BLOCK, (n, usages)


def test_the_billing_block_kept_defeats_the_cache(session):
    usages = replay(session(anthropic={"billing_header": "keep"}))
    # The nonce sits in the prompt's first hundred tokens: nothing after it matches.
    assert all(u["cache_read_input_tokens"] <= 96 for u in usages), usages
    assert usages[1]["input_tokens"] > 2000


def test_count_tokens_leaves_the_billing_block_out_too(session):
    client = session()
    body = {"model": "m", "system": system("01"), "messages": turns()[0], "tools": TOOLS}
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    plain = client.post("/v1/messages/count_tokens", json={**body, "system": system("01")[1:]}).json()
    assert counted == plain["input_tokens"]


def test_an_unknown_anthropic_option_is_refused(echo_app):
    from llmserve.errors import ConfigError

    with pytest.raises(ConfigError, match="billing-header: must be one of .drop. or .keep., got .pin."):
        echo_app(anthropic={"billing_header": "pin"})
