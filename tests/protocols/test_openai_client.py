"""The official ``openai`` Python client against the real embedded SmolLM2: every route, streamed
and not. The vLLM-only routes the client has no method for (tokenize, detokenize) go through httpx.

Greedy output (temperature 0) is deterministic here, so streamed and non-streamed results of the
same request are compared with each other rather than with hard-coded text.
"""

from __future__ import annotations

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "Count: 1, 2, 3,"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(smollm_server):
    return smollm_server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def stream_chat(client, **kwargs):
    return list(client.chat.completions.create(stream=True, **kwargs))


def chat_text(chunks, index=0):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


# -- models ------------------------------------------------------------------------------------
def test_models_list_and_retrieve(client, model):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model] and listed.data[0].object == "model"
    card = client.models.retrieve(model)
    assert card.id == model and card.owned_by == "llmserve"
    assert card.model_extra["max_model_len"] == card.model_extra["context_length"] == 2048
    assert listed.data[0].model_extra["context_length"] == 2048  # what agent clients read to size prompts
    assert card.model_extra["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    # One served name: any name is answered under it (the 404 of --strict-model-name is in
    # test_model_names_clients.py)
    assert client.models.retrieve("no-such-model").id == model


# -- chat --------------------------------------------------------------------------------------
def test_chat_greedy_answers_paris_stream_and_not(client, model):
    args = dict(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = stream_chat(client, **args)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chat_text(chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)  # no stream_options: no usage at all


def test_chat_n3_stream_and_not(client, model):
    args = dict(model=model, messages=[{"role": "user", "content": "Name a color."}], n=3, temperature=1.0,
                seed=7, max_tokens=6)
    r = client.chat.completions.create(**args)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in r.choices)
    # Usage counts the tokens of all three choices (each stops at EOS or at its 6 tokens).
    assert 3 <= r.usage.completion_tokens <= 18
    chunks = stream_chat(client, **args, stream_options={"include_usage": True})
    seen = {c.choices[0].index for c in chunks if c.choices}
    assert seen == {0, 1, 2}
    finishes = {c.choices[0].index: c.choices[0].finish_reason
                for c in chunks if c.choices and c.choices[0].finish_reason}
    assert set(finishes) == {0, 1, 2}
    texts = [chat_text(chunks, i) for i in range(3)]
    assert all(texts)
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_stop_string_cuts_the_greedy_answer(client, model):
    base = dict(model=model, messages=[{"role": "user", "content": "List the numbers from 1 to 10."}],
                temperature=0, max_tokens=24)
    full = client.chat.completions.create(**base).choices[0].message.content
    # Stop on the third character-run of the greedy answer: the output must end right before it.
    cut = full.find("3")
    assert cut > 0, full
    stop = full[cut:cut + 2]
    r = client.chat.completions.create(**base, stop=[stop, "@@never@@"])
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    chunks = stream_chat(client, **base, stop=stop)
    assert chat_text(chunks) == full[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stream_include_usage(client, model):
    args = dict(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**args)
    chunks = stream_chat(client, **args, stream_options={"include_usage": True})
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_chat_logprobs_top5_stream_and_not(client, model):
    args = dict(model=model, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5)
    r = client.chat.completions.create(**args)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 5 and len({t.token for t in tops}) == 5
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert all(t.logprob <= 0 for t in tops) and entry.bytes == list(entry.token.encode())
        # Greedy: the sampled token is the most likely one.
        assert tops[0].token == entry.token and tops[0].logprob == entry.logprob
    chunks = stream_chat(client, **args)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [len(t.top_logprobs) for t in streamed] == [5] * len(content)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_chat_bad_request_is_a_client_error(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=QUESTION, temperature=-1)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    assert info.value.type == "invalid_request_error"


# -- completions -------------------------------------------------------------------------------
def test_completion_greedy_paris_stream_and_not(client, model):
    args = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    r = client.completions.create(**args)
    assert "Paris" in r.choices[0].text and r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_n3_stream_and_not(client, model):
    args = dict(model=model, prompt="My favourite animal is the", n=3, temperature=1.0, seed=3, max_tokens=5,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text for c in r.choices)
    assert r.usage.completion_tokens == 15 and {c.finish_reason for c in r.choices} == {"length"}
    chunks = list(client.completions.create(stream=True, **args))
    by_index: dict[int, str] = {}
    for c in chunks:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert sorted(by_index) == [0, 1, 2] and all(by_index.values())


def test_completion_stop_strings_stream_and_not(client, model):
    base = dict(model=model, prompt=COUNT, temperature=0, max_tokens=12)
    full = client.completions.create(**base).choices[0].text
    cut = full.find(" 6")
    assert cut > 0, full
    r = client.completions.create(**base, stop=[" 6", "@@never@@"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    kept = client.completions.create(**base, stop=" 6", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut + 2]
    chunks = list(client.completions.create(stream=True, **base, stop=" 6"))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_stream_include_usage(client, model):
    args = dict(model=model, prompt=["The capital of France is", COUNT], temperature=0, max_tokens=3)
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 6


def test_completion_logprobs5_stream_and_not(client, model):
    args = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=5)
    r = client.completions.create(**args)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 5 and max(top, key=top.get) == token
        assert top[token] == logprob == max(top.values()) and logprob <= 0
    chunks = list(client.completions.create(stream=True, **args))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_completion_list_and_token_id_prompts(client, model, url):
    prompts = ["The capital of France is", COUNT]
    singles = [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=4).choices[0].text
               for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, temperature=0, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1] and [c.text for c in batch.choices] == singles
    ids = [httpx.post(url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    one = client.completions.create(model=model, prompt=ids[0], temperature=0, max_tokens=4)
    assert one.choices[0].text == singles[0] and one.usage.prompt_tokens == len(ids[0])
    many = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=4)
    assert [c.text for c in many.choices] == singles
    assert many.usage.prompt_tokens == sum(map(len, ids))


# -- vLLM routes the client has no method for ------------------------------------------------
def test_tokenize_detokenize_round_trip(client, model, url):
    r = httpx.post(url + "/tokenize", json={"model": model, "prompt": COUNT, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    back = httpx.post(url + "/detokenize", json={"model": model, "tokens": r["tokens"]}).json()
    assert back["prompt"] == COUNT
    # The chat form counts exactly the prompt tokens a chat completion is billed for.
    chat = httpx.post(url + "/tokenize", json={"model": model, "messages": QUESTION}).json()
    billed = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == billed
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
