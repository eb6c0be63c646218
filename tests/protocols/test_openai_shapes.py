"""OpenAI dialect wire shapes on the echo backend (fast; the real-model tests live beside)."""

import json

import pytest


def sse_events(text):
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture
def client(echo_app):
    c, _ = echo_app(strict_model_name=True)  # an unknown model is a 404 (test_models_routes)
    return c


def test_completion_indices_follow_prompt_times_n(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cd", "ef"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == ["ab", "ab", "cd", "cd", "ef", "ef"]
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == 6
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")


def test_completion_token_id_prompts(client):
    r = client.post("/v1/completions", json={"prompt": [[104, 105], [111, 107]], "max_tokens": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["hi", "ok"]
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [104, 105] and choice["token_ids"] == [104, 105]


def test_echo_logprobs_lead_with_null(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] == "abca"
    assert lp["tokens"] == ["a", "b", "c", "a"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [0, 1, 2, 3]


def test_completion_stream_with_usage(client):
    r = client.post("/v1/completions", json={"prompt": "hey", "stream": True, "max_tokens": 5,
                                             "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "hey"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert len({e["id"] for e in events}) == 1


def test_chat_without_template_and_with_request_template(echo_app):
    client, _ = echo_app()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template": template})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    trusted, _ = echo_app(trust_request_chat_template=True)
    r = trusted.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "chat_template": template, "n": 2})
    body = r.json()
    assert r.status_code == 200, body
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "hi"}] * 2
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")


def test_chat_stream_first_delta_has_role(echo_app):
    client, _ = echo_app(trust_request_chat_template=True)
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "yo"}], "stream": True,
        "chat_template": "{{ messages[0].content }}"})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "yo"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(e["object"] == "chat.completion.chunk" for e in events)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "model": "nope"}, "model"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({}, "prompt"),
])
def test_completion_invalid_params_name_the_param(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}
    assert r.headers.get("x-should-retry") == "false"


def test_request_id_used_and_not_json(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.json()["id"] == "cmpl-abc-123"  # echoed as a header only with --enable-request-id-headers
    r = client.post("/v1/completions", content=b"[1,2", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body is not valid JSON"
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "error" in r.json()


def test_models_routes(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "echo"
    assert client.get("/v1/models/echo").json()["id"] == "echo"
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.get("/version").json()["version"]


def test_seeded_sampling_on_the_real_model(smollm_server):
    import httpx

    def run(seed):
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": 2}
        r = httpx.post(smollm_server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    first, again, other = run(1234), run(1234), run(99)
    assert first == again  # same seed and input: same output
    assert first != other  # another seed: another output
    assert first[0] != first[1]  # the n sequences of one request get seed + j
