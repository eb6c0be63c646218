"""The Anthropic SDK against a SmolLM2 server started with ``--api-key`` and
``--reasoning-parser deepseek_r1``: the SDK's ``X-Api-Key`` (and Bearer) authentication, a
wrong key as ``AuthenticationError``, and thinking blocks from the reasoning parser, streamed
and not. (SmolLM2 never writes ``</think>``, so under deepseek_r1 its whole reply is thinking.)"""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

KEY = "sk-anthropic-test"
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
# Adaptive thinking: no budget, so a short max_tokens is allowed (a budget must be below max_tokens).
THINKING = {"type": "adaptive"}


@pytest.fixture(scope="module")
def url():
    from conftest import ServerProcess

    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--max-model-len", "1024", "--api-key", KEY,
                           "--reasoning-parser", "deepseek_r1", "--log-level", "warning")
    try:
        yield server.wait_ready(timeout=600).url
    finally:
        server.stop()


def sdk(url: str, **auth) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=300, **auth)


def test_x_api_key_and_bearer(url):
    msg = sdk(url, api_key=KEY).messages.create(model="m", max_tokens=4, messages=QUESTION)
    assert msg.usage.output_tokens == 4
    assert sdk(url, auth_token=KEY).messages.count_tokens(model="m", messages=QUESTION).input_tokens > 5
    for auth in ({"api_key": "sk-wrong"}, {"auth_token": "sk-wrong"}):
        client = sdk(url, **auth)
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(model="m", max_tokens=4, messages=QUESTION)
        assert info.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            client.messages.count_tokens(model="m", messages=QUESTION)
        with pytest.raises(anthropic.AuthenticationError):
            with client.messages.stream(model="m", max_tokens=4, messages=QUESTION) as stream:
                stream.get_final_message()


def test_thinking_blocks_streamed_and_not(url):
    client = sdk(url, api_key=KEY)
    args = dict(model="m", max_tokens=16, messages=QUESTION, thinking=THINKING, extra_body={"temperature": 0})
    msg = client.messages.create(**args)
    assert msg.stop_reason == "max_tokens"
    (block,) = msg.content
    assert isinstance(block, anthropic.types.ThinkingBlock)
    assert block.thinking.strip() and isinstance(block.signature, str) and block.signature
    kinds = []
    with client.messages.stream(**args) as stream:
        for ev in stream:
            if ev.type == "content_block_delta":
                kinds.append(ev.delta.type)
        final = stream.get_final_message()
    assert kinds[-1] == "signature_delta" and set(kinds[:-1]) == {"thinking_delta"} and len(kinds) > 2
    assert [b.to_dict() for b in final.content] == [block.to_dict()]
    # The thoughts go back in history with their signature (what the SDK's to_param gives).
    again = client.messages.create(model="m", max_tokens=4, thinking=THINKING,
                                   messages=QUESTION + [msg.to_param(), {"role": "user", "content": "Go on."}])
    assert again.usage.output_tokens == 4
    # A budget must be below max_tokens, as Anthropic's API requires; the SDK raises its own error.
    refused = r"must be greater than `thinking.budget_tokens` \(16 <= 1024\)"
    with pytest.raises(anthropic.BadRequestError, match=refused):
        client.messages.create(**{**args, "thinking": {"type": "enabled", "budget_tokens": 1024}})
