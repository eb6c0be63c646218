"""Hostile input to a real server process (echo backend, context 512): a megabyte stop string
with n=4 in every dialect that takes stop strings, ten-megabyte prompts, and a hundred
over-long prompts in a row. Each is refused (400 in the dialect's format) or runs bounded;
the server's memory stays flat (its RSS read from /proc) and /health keeps answering."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import ECHO_PLUGIN, ServerProcess

from .clients import ECHO_TEMPLATE

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning", "--trust-request-chat-template")
MB = 1024 * 1024


def rss(server: ServerProcess) -> int:
    """The server process's resident memory in bytes, from /proc."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def stop_cases(stop: str | list[str]) -> list[tuple[str, str, dict]]:
    """(name, path, body) for every dialect route that takes stop strings, n=4 where it has n.
    (Anthropic's ``stop_sequences`` reach the same check in the engine client; its route needs a
    chat template, which the echo model lacks, so it is not driven from here.)"""
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}], "chat_template": ECHO_TEMPLATE}
    stops = stop if isinstance(stop, list) else [stop]
    return [
        ("openai-completions", "/v1/completions",
         {"model": "echo", "prompt": "hello there", "max_tokens": 8, "n": 4, "temperature": 1.0, "stop": stops}),
        ("openai-chat", "/v1/chat/completions", {**chat, "max_tokens": 8, "n": 4, "temperature": 1.0, "stop": stop}),
        ("openai-chat-stream", "/v1/chat/completions",
         {**chat, "max_tokens": 8, "n": 4, "temperature": 1.0, "stop": stops, "stream": True}),
        ("tgi-generate", "/generate", {"inputs": "hello there", "parameters": {"max_new_tokens": 8, "stop": stops}}),
        ("tgi-generate-stream", "/generate_stream",
         {"inputs": "hello there", "parameters": {"max_new_tokens": 8, "stop": stops}}),
        ("vllm-generate", "/generate",
         {"prompt": "hello there", "max_tokens": 8, "n": 4, "temperature": 1.0, "stop": stops}),
        ("ollama-generate", "/api/generate", {"model": "echo", "prompt": "hello there", "raw": True, "stream": False,
                                              "options": {"num_predict": 8, "stop": stops}}),
    ]


def refused(r: httpx.Response, field: str) -> bool:
    """A 4xx in the route's format: OpenAI's envelope naming ``field`` in ``param``, or the flat
    ``{"error": message, "error_type"}`` of TGI and MindIE (whose messages name no field)."""
    if not 400 <= r.status_code < 500:
        return False
    error = r.json()["error"]
    return field in (error["param"] or "") if isinstance(error, dict) else bool(error)


@pytest.fixture(scope="module")
def default_server():
    server = ServerProcess(*ECHO).wait_ready()
    yield server
    server.stop()


def test_megabyte_stop_string_is_refused_in_every_dialect(default_server):
    server = default_server
    stop = "ab" * (MB // 2)
    before = rss(server)
    for name, path, body in stop_cases(stop):
        for _ in range(3):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert refused(r, "stop"), (name, r.status_code, r.text[:300])
    grown = rss(server) - before
    assert grown < 50 * MB, grown / MB
    r = httpx.post(server.url + "/v1/completions", json={"model": "echo", "prompt": "still fine", "max_tokens": 12},
                   timeout=30)
    assert r.json()["choices"][0]["text"] == "still fine"


def test_megabyte_stop_string_runs_bounded_when_the_operator_allows_it(server_process):
    # With the cap raised past a megabyte, the stop checker itself must stay linear.
    server = server_process(*ECHO, "--max-stop-chars", str(2 * MB))
    stop = "ab" * (MB // 2)
    before = rss(server)
    for name, path, body in stop_cases(stop):
        r = httpx.post(server.url + path, json=body, timeout=120)
        if name.startswith("vllm"):  # vLLM-native keeps its own 32k-character cap
            assert refused(r, "stop"), (name, r.status_code, r.text[:300])
            continue
        assert r.status_code == 200, (name, r.status_code, r.text[:300])
        if name == "openai-chat-stream":  # one character per event: the run ended normally
            assert '"error"' not in r.text and '"finish_reason":"length"' in r.text, (name, r.text[-300:])
        else:
            assert "hello" in r.text, (name, r.text[:300])
    grown = rss(server) - before
    assert grown < 50 * MB, grown / MB


def test_too_many_stop_strings_are_refused(default_server):
    for name, path, body in stop_cases([f"s{i}" for i in range(65)]):
        if name.startswith("tgi"):
            continue  # TGI's own cap (4 stop sequences) answers first
        r = httpx.post(default_server.url + path, json=body, timeout=30)
        assert refused(r, "stop"), (name, r.status_code, r.text[:300])


TEN_MB_ROUTES = [
    ("openai-completions", "/v1/completions", lambda p: {"model": "echo", "prompt": p, "max_tokens": 4}, "prompt"),
    ("openai-chat", "/v1/chat/completions",
     lambda p: {"model": "echo", "messages": [{"role": "user", "content": p}], "chat_template": ECHO_TEMPLATE},
     "messages"),
    ("openai-tokenize", "/tokenize", lambda p: {"model": "echo", "prompt": p}, "prompt"),
    ("openai-tokenize-messages", "/tokenize",
     lambda p: {"model": "echo", "messages": [{"role": "user", "content": p}]}, "messages"),
    ("tgi-generate", "/generate", lambda p: {"inputs": p, "parameters": {"max_new_tokens": 4}}, "inputs"),
    ("tgi-tokenize", "/tokenize", lambda p: {"inputs": p}, "inputs"),
    ("vllm-generate", "/generate", lambda p: {"prompt": p, "max_tokens": 4}, "prompt"),
    ("mindie-infer", "/infer", lambda p: {"inputs": p, "parameters": {"max_new_tokens": 4}}, "inputs"),
    ("mindie-tokenizer", "/v1/tokenizer", lambda p: {"inputs": p}, "inputs"),
    ("triton-generate", "/v2/models/echo/generate", lambda p: {"text_input": p}, ""),
]


def test_ten_megabyte_prompts_are_refused_while_health_answers(default_server):
    server = default_server
    prompt = "word " * (2 * MB)  # 10 MB
    worst: list[float] = []
    done = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get(server.url + "/health").status_code == 200
                worst.append(time.monotonic() - t0)
                time.sleep(0.02)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        for name, path, build, field in TEN_MB_ROUTES:
            r = httpx.post(server.url + path, json=build(prompt), timeout=60)
            assert refused(r, field), (name, r.status_code, r.text[:300])
            assert "characters" in r.text or "MB" in r.text, (name, r.text[:300])
    finally:
        done.set()
        pinger.join(30)
    assert worst and max(worst) < 2.0, max(worst)  # generous: a loaded test machine


def test_a_hundred_over_long_prompts_in_a_row(default_server):
    server = default_server
    with httpx.Client(timeout=30) as client:
        for i in range(100):
            # Alternately over the context (tokenized, then refused) and over the character cap.
            prompt = "x" * (600 + i) if i % 2 else "y" * (20_000 + i)
            r = client.post(server.url + "/v1/completions", json={"model": "echo", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text[:300]
        assert client.get(server.url + "/health").status_code == 200
        r = client.post(server.url + "/v1/completions", json={"model": "echo", "prompt": "alive", "max_tokens": 8})
        assert r.json()["choices"][0]["text"] == "alive"
    assert server.proc.poll() is None
