"""vLLM's extra OpenAI fields, answered as vLLM answers them: prompt_logprobs, the null keys of
its replies, truncate_prompt_tokens, allowed_token_ids, return_tokens_as_token_ids,
logprob_token_ids, the refusals (beam search, stream_options without stream, a prompt both
continued and given a generation prompt) and the score route's spellings.

Fast tests drive the echo backend (it generates the prompt back; its prompt logprobs are -1.0
with the prompt token as the one alternative) through the real ``openai`` client; the sampling
fields that need a model are checked on the sampler and, marked slow, on the embedded SmolLM2.
"""

from __future__ import annotations

import json

import openai
import pytest

from .test_openai_shapes import sse_events

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
CHAT = {"chat_template": TEMPLATE}


@pytest.fixture
def http(echo_app):
    client, _ = echo_app(trust_request_chat_template=True)
    return client


@pytest.fixture
def oai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def chat(oai, content="hi", **extra):
    return oai.chat.completions.create(model="echo", messages=[{"role": "user", "content": content}],
                                       max_tokens=8, extra_body={**CHAT, **extra})


def refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    error = info.value.body
    assert error["param"] == param, error
    return error["message"]


# ------------------------------------------------------------------------- prompt_logprobs
def test_completion_prompt_logprobs_per_choice(oai):
    r = oai.completions.create(model="echo", prompt="abc", max_tokens=1, n=2, extra_body={"prompt_logprobs": 1})
    for choice in r.choices:
        assert choice.prompt_logprobs == [
            None,
            {"98": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}},
            {"99": {"logprob": -1.0, "rank": 1, "decoded_token": "c"}},
        ]


def test_chat_prompt_logprobs_on_the_reply(oai):
    r = chat(oai, "hey", prompt_logprobs=0)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == r.usage.prompt_tokens == 3
    assert r.prompt_logprobs[2] == {"121": {"logprob": -1.0, "rank": 1, "decoded_token": "y"}}
    assert not hasattr(r.choices[0], "prompt_logprobs")


def test_prompt_logprobs_refusals(oai):
    # -1 is the whole vocabulary (257 tokens on echo): over the cap of 20, in vLLM's words.
    message = refused(lambda: chat(oai, prompt_logprobs=-1), "prompt_logprobs")
    assert message == "Requested prompt logprobs of 257, which is greater than max allowed: 20"
    refused(lambda: oai.completions.create(model="echo", prompt="a", extra_body={"prompt_logprobs": -1}),
            "prompt_logprobs")
    assert "positive value or -1" in refused(
        lambda: oai.completions.create(model="echo", prompt="a", extra_body={"prompt_logprobs": -2}),
        "prompt_logprobs")
    assert "stream=True" in refused(lambda: list(oai.completions.create(
        model="echo", prompt="a", stream=True, extra_body={"prompt_logprobs": 2})), "prompt_logprobs")
    assert "stream=True" in refused(lambda: list(oai.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a"}], stream=True,
        extra_body={**CHAT, "prompt_logprobs": 1})), "prompt_logprobs")


def test_prompt_logprobs_follow_the_servers_max_logprobs(echo_app):
    client, _ = echo_app(max_logprobs=2)
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Requested prompt logprobs of 3, which is greater than max allowed: 2"
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"][1]["98"]["rank"] == 1


# ------------------------------------------------------------------------- keys vLLM always sends
def test_completion_choice_keys_are_null_when_not_asked(oai, http):
    choice = oai.completions.create(model="echo", prompt="ab", max_tokens=2).choices[0]
    assert choice.prompt_logprobs is None and choice.prompt_token_ids is None and choice.token_ids is None
    raw = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).json()["choices"][0]
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"} <= set(raw)


def test_chat_reply_keys_are_null_when_not_asked(oai):
    r = chat(oai)
    assert r.prompt_logprobs is None and r.prompt_token_ids is None and r.choices[0].token_ids is None


def test_chat_return_token_ids_puts_prompt_ids_on_the_reply(oai, http):
    r = chat(oai, "hi", return_token_ids=True)
    assert r.prompt_token_ids == [104, 105] and r.choices[0].token_ids == [104, 105, 256]  # EOS included
    assert not hasattr(r.choices[0], "prompt_token_ids")
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True, **CHAT}
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    assert events[0]["prompt_token_ids"] == [104, 105]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert all("prompt_token_ids" not in c for e in events for c in e["choices"])


def test_completion_stream_sends_prompt_ids_on_each_choices_first_chunk(http):
    body = {"prompt": ["ab", "cd"], "n": 2, "stream": True, "max_tokens": 2, "return_token_ids": True}
    firsts: dict[int, dict] = {}
    for event in sse_events(http.post("/v1/completions", json=body).text):
        for c in event["choices"]:
            firsts.setdefault(c["index"], c)
    assert {i: c.get("prompt_token_ids") for i, c in firsts.items()} == {
        0: [97, 98], 1: [97, 98], 2: [99, 100], 3: [99, 100]}


def test_tokenize_always_has_token_strs(http):
    r = http.post("/tokenize", json={"prompt": "ab"}).json()
    assert r == {"count": 2, "max_model_len": 512, "tokens": [97, 98], "token_strs": None}
    assert http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()["token_strs"] == ["a", "b"]


# ------------------------------------------------------------------------- truncate_prompt_tokens
def test_completion_truncation_keeps_the_end_by_default(oai):
    r = oai.completions.create(model="echo", prompt="abcdef", max_tokens=8, echo=True,
                               extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == "defdef"
    r = oai.completions.create(model="echo", prompt="abcdef", max_tokens=8,
                               extra_body={"truncate_prompt_tokens": 2, "truncation_side": "right"})
    assert r.usage.prompt_tokens == 2 and r.choices[0].text == "ab"
    r = oai.completions.create(model="echo", prompt=[97, 98, 99], max_tokens=8,
                               extra_body={"truncate_prompt_tokens": -1})  # -1: the context length
    assert r.usage.prompt_tokens == 3


def test_chat_truncation_applies_to_the_rendered_prompt(oai):
    r = chat(oai, "hello", truncate_prompt_tokens=2)
    assert r.usage.prompt_tokens == 2 and r.choices[0].message.content == "lo"


def test_truncation_over_the_context_is_refused(oai):
    message = refused(lambda: chat(oai, truncate_prompt_tokens=513), "truncate_prompt_tokens")
    assert message == ("truncate_prompt_tokens value is greater than max_model_len. Please, select a smaller "
                       "truncation size.")
    refused(lambda: oai.completions.create(model="echo", prompt="a", extra_body={"truncate_prompt_tokens": -2}),
            "truncate_prompt_tokens")


# ------------------------------------------------------------------------- token naming, token-id fields
def test_return_tokens_as_token_ids(oai):
    lp = oai.completions.create(model="echo", prompt="ab", max_tokens=2, logprobs=1,
                                extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert lp.tokens == ["token_id:97", "token_id:98"]
    assert lp.top_logprobs[0] == {"token_id:97": -0.5}
    content = chat(oai, "hi", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    entries = content.choices[0].logprobs.content
    assert [e.token for e in entries] == ["token_id:104", "token_id:105", "token_id:256"]  # EOS last
    assert entries[0].bytes == list(b"token_id:104") and entries[0].top_logprobs[0].token == "token_id:104"


def test_completion_top_logprobs_start_with_the_token():
    """vLLM's order: each entry names the token itself first, then its alternatives (a prompt
    token under echo is seldom the model's best guess; clients read the first key as the token)."""
    from llmserve.outputs import TokenLogprob
    from llmserve.plugins.protocols.openai.replies import TOKEN_IDS, completion_logprobs

    entry = TokenLogprob(7, -3.0, [(1, -0.1), (2, -0.5), (7, -3.0)])
    out = completion_logprobs([(5, None), (7, entry)], TOKEN_IDS, 0, 2)
    assert out["tokens"] == ["token_id:5", "token_id:7"] and out["top_logprobs"][0] is None
    assert list(out["top_logprobs"][1].items()) == [("token_id:7", -3.0), ("token_id:1", -0.1), ("token_id:2", -0.5)]


def test_return_tokens_as_token_ids_server_default(echo_app):
    client, _ = echo_app(return_tokens_as_token_ids=True)
    body = {"prompt": "ab", "max_tokens": 1, "logprobs": 0}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"] == ["token_id:97"]
    body["return_tokens_as_token_ids"] = False  # the request's own choice wins
    assert client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"] == ["a"]


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": [97, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"logprob_token_ids": [97], "logprobs": None}, "logprob_token_ids"),
    ({"logprob_token_ids": [], "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": [10**6], "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": list(range(21)), "logprobs": 1}, "logprob_token_ids"),
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_field_refusals(http, extra, param):
    body = {k: v for k, v in {"prompt": "ab", "max_tokens": 2, **extra}.items() if v is not None}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_stream_options_need_stream_and_beam_search_is_refused(oai):
    assert refused(lambda: chat(oai, stream_options={"include_usage": True}), "stream_options") == (
        "Stream options can only be defined when `stream=True`.")
    refused(lambda: chat(oai, use_beam_search=True, n=2, length_penalty=0.5, early_stopping=True), "use_beam_search")
    refused(lambda: chat(oai, logprob_token_ids=[104]), "logprob_token_ids")  # needs logprobs: true


def test_length_penalty_and_early_stopping_alone_are_accepted(oai):
    assert chat(oai, length_penalty=0.5, early_stopping=False).choices[0].message.content == "hi"


# ------------------------------------------------------------------------- generation prompt xor continue
def test_continue_final_message_with_generation_prompt_is_refused(oai, http):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    both = {"continue_final_message": True, "add_generation_prompt": True}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="echo", messages=messages, max_tokens=4, extra_body={**CHAT, **both})
    assert info.value.body["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    r = http.post("/tokenize", json={"messages": messages, **both})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    alone = oai.chat.completions.create(model="echo", messages=messages, max_tokens=8,
                                        extra_body={**CHAT, "continue_final_message": True})
    assert alone.choices[0].message.content == "hihe"


# ------------------------------------------------------------------------- sampler: allowed and chosen ids
def test_sampler_allowed_token_ids_and_logprob_token_ids():
    torch = pytest.importorskip("torch")
    from llmserve.engine.backend import StepItem
    from llmserve.plugins.backends.torch.sampler import Sampler, ranked_prompt_logprobs
    from llmserve.sampling import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[:, 7] = 30.0  # the clear favourite, banned below by allowed_token_ids
    params = [SamplingParams(temperature=0, allowed_token_ids=[3, 11], logprobs=2),
              SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[20]),
              SamplingParams(temperature=0, logprobs=2, logprob_token_ids=[9, 7])]
    items = [StepItem(seq_id=i, token_ids=[1], start_pos=0, block_table=[0], sampling=p) for i, p in enumerate(params)]
    out = Sampler(50, [0]).sample(logits, items)
    assert out[0].token_id == (3 if logits[0, 3] > logits[0, 11] else 11)
    assert out[1].token_id == 20
    assert out[2].token_id == 7
    lsm = torch.log_softmax(logits[2], -1)
    assert [t for t, _ in out[2].top] == [9, 7]
    assert out[2].top[0][1] == pytest.approx(float(lsm[9]), abs=1e-5)
    # Prompt ranks: 1 for the row's best token, k + 1 for a token k others beat.
    rows, ranks = ranked_prompt_logprobs(logits, [7, 7, int(logits[2].argsort()[-4])], 1)
    assert ranks == [1, 1, 4] and rows[0][1][0][0] == 7


# ------------------------------------------------------------------------- score route spellings
@pytest.fixture(scope="module")
def embed_client():
    from fastapi.testclient import TestClient

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    config, _ = load_config({"task": "embed", "protocols": ["openai"], "max_model_len": 64}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_score_accepts_every_vllm_spelling(embed_client):
    docs = ["Bananas are yellow.", "Paris is the capital of France."]
    base = embed_client.post("/score", json={"text_1": "capital of France", "text_2": docs}).json()
    scores = [d["score"] for d in base["data"]]
    assert scores[1] > scores[0]
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        r = embed_client.post("/v1/score", json={first: "capital of France", second: docs})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(scores)
    r = embed_client.post("/score", json={"queries": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_embeddings_truncation(embed_client):
    long = "word " * 200  # well over the 64-token context
    r = embed_client.post("/v1/embeddings", json={"input": long})
    assert r.status_code == 400
    r = embed_client.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    r = embed_client.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 10})
    assert r.json()["usage"]["prompt_tokens"] == 10
    r = embed_client.post("/v1/embeddings", json={"input": "hi", "truncate_prompt_tokens": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


# ------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_smollm_prompt_logprobs_and_sampling_fields(smollm_server):
    import httpx

    client = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def tokens(text: str, special: bool = True) -> list[int]:
        body = {"prompt": text, "add_special_tokens": special}
        return httpx.post(smollm_server.url + "/tokenize", json=body, timeout=60).json()["tokens"]

    prompt = "The capital of France is Paris"
    ids = tokens(prompt)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    for position, token in zip(plp[1:], ids[1:]):
        position = dict(position)
        mine = position.pop(str(token))
        assert mine["rank"] >= 1 and mine["logprob"] <= 0 and isinstance(mine["decoded_token"], str)
        # The best three follow, unless the prompt token is one of them (then it stands for itself).
        ranks = sorted(v["rank"] for v in position.values())
        assert ranks == [r for r in (1, 2, 3) if r != mine["rank"]]
        assert all(v["logprob"] <= 0 for v in position.values())
    last = r.choices[0].prompt_logprobs[-1][str(ids[-1])]
    assert last["decoded_token"] == " Paris" and last["rank"] == 1
    # The prefix cache is warm now; a prompt_logprobs request still computes (and reports) every position.
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 3}).choices[0].prompt_logprobs
    assert json.dumps(again) == json.dumps(r.choices[0].prompt_logprobs)

    # allowed_token_ids: only they are sampled (greedy or not), never the favourite " Paris".
    paris, london = ids[-1], tokens(" London", special=False)[0]
    for temperature in (0, 1.0):
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3,
                                      temperature=temperature, extra_body={"allowed_token_ids": [london]})
        assert r.choices[0].text == " London" * 3
    # logprob_token_ids: the named tokens' logprobs, after the sampled token's own (vLLM's order).
    free = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                     logprobs=1, extra_body={"logprob_token_ids": [london, paris]})
    choice = free.choices[0]
    assert choice.text == " Paris" and list(choice.logprobs.top_logprobs[0]) == [" Paris", " London"]
    assert choice.logprobs.top_logprobs[0][" Paris"] == pytest.approx(choice.logprobs.token_logprobs[0], abs=1e-4)
