"""Admission control on a real server process (echo backend, 50 ms per step): caps on
requests in flight, waiting requests and waiting prompt tokens; n / best_of / prompts count
as sequences; refusals are 503 + Retry-After in each dialect's format (TGI: 429 overloaded,
as its client expects), happen before any tokenizing, are counted in /metrics, and the
capacity comes back when requests end."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from text_generation import Client as TGIClient
from text_generation.errors import OverloadedError

from conftest import ECHO_PLUGIN

from .clients import ECHO_TEMPLATE, Dropped

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN, "--trust-request-chat-template", "--log-level", "warning")
SLOW = {"LLMSERVE_ECHO_STEP_DELAY": "0.05"}
HOLD = {"prompt": "x" * 300, "max_tokens": 150, "stream": True}


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def gauge(server, name: str) -> float:
    match = re.search(r"%s\{[^}]*\} ([0-9.]+)\n" % re.escape(name), httpx.get(server.url + "/metrics").text)
    return float(match.group(1)) if match else -1.0


def hold(server, count: int) -> list[Dropped]:
    """``count`` more long streaming requests, each admitted and in the engine (running or queued)."""
    before = gauge(server, "vllm:num_requests_running") + gauge(server, "vllm:num_requests_waiting")
    held = [Dropped(server.url, "/v1/completions", HOLD) for _ in range(count)]
    for h in held:
        h.read_some(b"\r\n\r\n")
    end = time.time() + 20
    while gauge(server, "vllm:num_requests_running") + gauge(server, "vllm:num_requests_waiting") < before + count:
        assert time.time() < end, "the held requests did not reach the engine"
        time.sleep(0.02)
    return held


def rejection_count(server, reason: str) -> int:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(r'llmserve:admission_rejections_total\{[^}]*reason="%s"\} ([0-9.]+)' % reason, text)
    return int(float(match.group(1))) if match else 0


def wait_gauge(server, name: str, value: int) -> None:
    end = time.time() + 20
    while gauge(server, name) != value:
        assert time.time() < end, f"{name} never reached {value}"
        time.sleep(0.05)


def assert_overloaded_everywhere(server) -> None:
    """Every generation route of every dialect refuses, in its own format."""
    client = oai(server)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
    assert err.value.body["type"] == "overloaded_error"
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template": ECHO_TEMPLATE})
    assert err.value.status_code == 503
    tgi = TGIClient(server.url, timeout=30)
    with pytest.raises(OverloadedError):
        tgi.generate("hi", max_new_tokens=2)
    with pytest.raises(OverloadedError):
        list(tgi.generate_stream("hi", max_new_tokens=2))
    r = httpx.post(server.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded" and r.headers["retry-after"]
    r = httpx.post(server.url + "/generate", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error" and r.headers["retry-after"]
    r = httpx.post(server.url + "/infer", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 503 and r.json()["error_type"] == "Service Unavailable" and r.headers["retry-after"]
    for route in ("generate", "generate_stream"):
        r = httpx.post(server.url + f"/v2/models/echo/{route}", json={"text_input": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "overloaded" in r.json()["error"] and r.headers["retry-after"]
    r = httpx.post(server.url + "/v2/models/echo/infer", json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]})
    assert r.status_code == 503 and r.headers["retry-after"]


def test_waiting_cap_refuses_every_dialect_and_recovers(server_process):
    server = server_process(*ECHO, "--max-num-seqs", "2", "--max-waiting-requests", "1", env=SLOW)
    held = hold(server, 3)  # two run, one waits: the queue is full
    before = rejection_count(server, "waiting")
    assert_overloaded_everywhere(server)
    assert rejection_count(server, "waiting") - before == 10  # every refusal above, counted once
    for h in held:
        h.close()
    # Capacity comes back once the dropped requests are aborted.
    end = time.time() + 20
    while True:
        try:
            out = oai(server).completions.create(model="echo", prompt="back", max_tokens=4)
            break
        except openai.InternalServerError:
            assert time.time() < end, "the server never accepted requests again"
            time.sleep(0.1)
    assert out.choices[0].text == "back"


def test_n_best_of_and_prompts_count_as_sequences(server_process):
    server = server_process(*ECHO, "--max-num-seqs", "2", "--max-waiting-requests", "1", env=SLOW)
    client = oai(server)
    # Idle server: 3 sequences fit (2 run + 1 waits); 4 never can, which is the client's error.
    assert len(client.completions.create(model="echo", prompt="ab", max_tokens=2, n=3).choices) == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="echo", prompt="ab", max_tokens=2, n=4)
    assert err.value.body["param"] == "n"
    held = hold(server, 1)
    # One sequence in flight: 2 more fit, 3 more do not, however the request asks for them.
    for kwargs in ({"n": 3}, {"n": 1, "extra_body": {"best_of": 3}}, {"prompt": ["a", "b", "c"]}):
        args = {"model": "echo", "prompt": "ab", "max_tokens": 2, **kwargs}
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(**args)
        assert err.value.status_code == 503
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], n=3,
                                       max_tokens=2, extra_body={"chat_template": ECHO_TEMPLATE})
    r = httpx.post(server.url + "/generate", json={"prompt": "hi", "n": 2, "best_of": 3, "max_tokens": 2})
    assert r.status_code == 503
    r = httpx.post(server.url + "/v2/models/echo/infer", json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [3], "data": ["a", "b", "c"]}]})
    assert r.status_code == 503
    # Refused before tokenizing: an over-long prompt gets the 503, not the context-length 400.
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="echo", prompt="x" * 5000, max_tokens=2, n=3)
    assert len(client.completions.create(model="echo", prompt="ab", max_tokens=2, n=2).choices) == 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="echo", prompt="x" * 5000, max_tokens=2, n=1)
    for h in held:
        h.close()


def test_concurrency_cap_and_tgi_best_of(server_process):
    server = server_process(*ECHO, "--max-concurrent-requests", "2", env=SLOW)
    tgi = TGIClient(server.url, timeout=30)
    # best_of=2 takes both places at once; alone it runs.
    out = tgi.generate("hello", max_new_tokens=3, best_of=2, do_sample=True)
    assert out.generated_text == "hel"
    held = hold(server, 1)
    with pytest.raises(OverloadedError):
        tgi.generate("hello", max_new_tokens=3, best_of=2, do_sample=True)
    assert tgi.generate("hello", max_new_tokens=3).generated_text == "hel"  # one place left
    held += hold(server, 1)
    assert_overloaded_everywhere(server)
    assert rejection_count(server, "concurrent") == 11
    for h in held:
        h.close()


def test_waiting_prompt_token_cap(server_process):
    server = server_process(*ECHO, "--max-num-seqs", "1", "--max-waiting-tokens", "100", env=SLOW)
    running = hold(server, 1)
    wait_gauge(server, "vllm:num_requests_running", 1)  # it owns the only batch slot
    client = oai(server)
    # While fewer than 100 prompt tokens wait, requests are admitted and queue: 40, then 70 tokens.
    queued = []
    for size in (40, 70):
        queued.append(Dropped(server.url, "/v1/completions", {"prompt": "y" * size, "max_tokens": 2, "stream": True}))
        wait_gauge(server, "vllm:num_requests_waiting", len(queued))
    # Now 110 tokens wait (>= 100): the next request is refused before it is even tokenized.
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt="w", max_tokens=1)
    assert "prompt tokens are waiting" in err.value.message
    assert rejection_count(server, "waiting_tokens") == 1
    for h in running + queued:
        h.close()
