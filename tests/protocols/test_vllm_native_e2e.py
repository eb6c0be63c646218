"""vLLM-native ``POST /generate`` end to end on the real SmolLM2 server: every example of the
spec (MindIE "vLLM文本/流式推理接口") over plain HTTP, field for field, and vLLM's own
``examples/api_client.py`` way of reading the `\\0`-separated stream. max_tokens is capped at 16
(the spec's examples use 20) to keep the suite fast."""

from __future__ import annotations

import json

import httpx
import pytest
import requests

PROMPT = "My name is Olivier and I"

# The spec's single-modality request example, verbatim except max_tokens 20 -> 16.
SPEC_TEXT_EXAMPLE = {
    "prompt": PROMPT, "max_tokens": 16, "repetition_penalty": 1.03, "presence_penalty": 1.2,
    "frequency_penalty": 1.2, "temperature": 0.5, "top_p": 0.95, "top_k": 10, "seed": None, "stream": False,
    "stop": None, "stop_token_ids": None, "model": "None", "include_stop_str_in_output": False,
    "skip_special_tokens": True, "ignore_eos": False,
}
# The spec's curl streaming example, verbatim.
SPEC_STREAM_EXAMPLE = {"prompt": PROMPT, "stream": True, "repetition_penalty": 1.0, "top_p": 1.0, "top_k": 10,
                       "max_tokens": 16, "temperature": 1.0}


@pytest.fixture(scope="module")
def url(smollm_server):
    return smollm_server.url + "/generate"


def stream_records(url, body):
    """Read the stream exactly as vLLM's examples/api_client.py does."""
    response = requests.post(url, headers={"User-Agent": "Test Client", "Accept": "application/json"}, json=body,
                             stream=True, timeout=120)
    assert response.status_code == 200
    assert not response.headers["content-type"].startswith("text/event-stream")
    out = []
    for chunk in response.iter_lines(chunk_size=8192, decode_unicode=False, delimiter=b"\0"):
        if chunk:
            out.append(json.loads(chunk.decode("utf-8")))
    return out


def test_spec_text_example(url):
    r = httpx.post(url, json=SPEC_TEXT_EXAMPLE, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"text"} and isinstance(body["text"], list) and len(body["text"]) == 1
    text = body["text"][0]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_spec_stream_example(url):
    records = stream_records(url, SPEC_STREAM_EXAMPLE)
    assert records and all(set(r) == {"text"} and len(r["text"]) == 1 for r in records)
    texts = [r["text"][0] for r in records]
    assert all(t.startswith(PROMPT) for t in texts)
    for a, b in zip(texts, texts[1:]):  # cumulative: each record extends the previous one
        assert b.startswith(a)
    assert len(texts[-1]) > len(PROMPT)


def test_spec_multimodal_example_is_rejected_clearly(url):
    body = {**SPEC_TEXT_EXAMPLE, "prompt": [{"type": "text", "text": PROMPT},
                                            {"type": "image_url", "image_url": "/xxxx/test.png"}]}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "multimodal" in err["message"]


def test_images_for_a_text_model_are_refused(url):
    body = {**SPEC_TEXT_EXAMPLE, "multi_modal_data": {"image": "aGVsbG8="}}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "multi_modal_data.image" and "takes text only" in err["message"]


def test_stream_last_record_equals_non_stream(url):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    full = httpx.post(url, json=body, timeout=120).json()["text"][0]
    records = stream_records(url, {**body, "stream": True})
    assert records[-1]["text"][0] == full


def test_n_and_seed(url):
    body = {"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 0.9, "seed": 7}
    a = httpx.post(url, json=body, timeout=120).json()
    b = httpx.post(url, json=body, timeout=120).json()
    assert len(a["text"]) == 2 and a == b
    records = stream_records(url, {**body, "stream": True})
    assert all(len(r["text"]) == 2 for r in records)


def test_stop_and_include_stop_str(url):
    free = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}, timeout=120).json()["text"][0]
    generated = free[len(PROMPT):]
    words = [w for w in generated.split() if len(w) >= 3]
    assert words, generated
    stop = words[0]
    cut = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]},
                     timeout=120).json()["text"][0]
    kept = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": stop,
                                 "include_stop_str_in_output": True}, timeout=120).json()["text"][0]
    assert kept == cut + stop and not cut.endswith(stop)


def test_ignore_eos_fills_max_tokens(url):
    body = {"prompt": "Hi", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text"][0].startswith("Hi")


def test_validation_errors_use_the_openai_envelope(url):
    r = httpx.post(url, json={"prompt": PROMPT, "temperature": -1}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"
    r = httpx.post(url, json={"prompt": "hi " * 3000, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "maximum context length is 2048 tokens" in r.json()["error"]["message"]
