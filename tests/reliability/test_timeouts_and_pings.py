"""--request-timeout aborts a request and tells its client in the dialect's words (in-band on
streams); --sse-ping-interval keeps quiet SSE streams alive with ``: ping`` comments that the
official clients ignore. Real uvicorn on loopback (in this process, to check the engine's
idle invariant), echo backend at 50 ms per step."""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest
from text_generation import Client as TGIClient
from text_generation.errors import GenerationError

from .clients import ECHO_TEMPLATE, PROMPT, Dropped, dechunk, generation_routes


@pytest.fixture
def timeout_server(inproc_server, echo_flags, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", "0.05")
    return inproc_server(**echo_flags, request_timeout=0.6, sse_ping_interval=0)


def test_timeout_non_streaming_every_dialect(timeout_server):
    server = timeout_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="echo", prompt=PROMPT, max_tokens=150)
    assert err.value.status_code == 408 and err.value.body["type"] == "timeout_error"
    with pytest.raises(GenerationError, match="request timeout"):
        TGIClient(server.url, timeout=30).generate(PROMPT, max_new_tokens=150)
    expected = {"openai-chat": 408, "openai-completions-2-prompts": 408, "vllm-generate": 408,
                "mindie-infer": 424, "triton-generate": 408, "triton-infer-2-texts": 408, "tgi-compat": 408}
    for name, path, body, _streams in generation_routes():
        if name in expected:
            r = httpx.post(server.url + path, json=body, timeout=30)
            assert r.status_code == expected[name], (name, r.text)
            assert "timeout" in r.text, (name, r.text)
    server.check_idle()


def test_timeout_in_band_on_streams(timeout_server):
    server = timeout_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=150, stream=True, extra_body={"chat_template": ECHO_TEMPLATE})
    with pytest.raises(openai.APIError, match="request timeout"):
        for _ in stream:
            pass
    with pytest.raises(GenerationError, match="request timeout"):
        for _ in TGIClient(server.url, timeout=30).generate_stream(PROMPT, max_new_tokens=150):
            pass
    for name, path, body, streams in generation_routes():
        if not streams:
            continue
        text = httpx.post(server.url + path, json=body, timeout=30).text
        events = [e for e in re.split(r"\n\n|\0", text) if e.strip()]
        tail = events[-2] if events[-1] == "data: [DONE]" else events[-1]
        assert "timeout" in tail, (name, text[-300:])
        if name.startswith("openai"):
            assert text.endswith("data: [DONE]\n\n")
            last = json.loads(text.split("data: ")[-2])
            assert last["error"]["type"] == "timeout_error" and last["error"]["code"] == 408
    server.check_idle()


def test_sse_pings_while_queued_and_clients_ignore_them(inproc_server, echo_flags, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", "0.05")
    server = inproc_server(**echo_flags, max_num_seqs=1, sse_ping_interval=0.1)
    running = Dropped(server.url, "/v1/completions", {"prompt": "x" * 300, "max_tokens": 80, "stream": True})
    running.read_some(b"data:")  # owns the only batch slot for about 4 s
    routes = [r for r in generation_routes(prompt="hi", max_tokens=2) if r[3]]
    waiting = {name: Dropped(server.url, path, body) for name, path, body, _ in routes}
    for name, client in waiting.items():
        # SSE routes: from their headers on (a first chat template compiles first, slow on a busy
        # machine), 0.35 s holds three ping intervals and no data.
        head = b"" if name.startswith("vllm") else client.read_some(b"\r\n\r\n", limit=3.0)
        body = dechunk((head + client.read_for(0.35)).split(b"\r\n\r\n", 1)[-1])
        assert b"data:" not in body and b'"text"' not in body, f"{name} was not queued"
        if name.startswith("vllm"):  # not SSE: \0-separated JSON records, never a comment line
            assert b"ping" not in body, name
        else:
            assert body.startswith(b": ping\n\n") and set(body.split(b"\n\n")) <= {b": ping", b""}, (name, body)
        client.close()
    # The official clients read through the pings.
    results: dict[str, str] = {}

    def run_openai() -> None:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        results["openai"] = "".join(c.choices[0].text for c in client.completions.create(
            model="echo", prompt="pong", max_tokens=4, stream=True))

    def run_tgi() -> None:
        results["tgi"] = "".join(r.token.text for r in TGIClient(server.url, timeout=30).generate_stream(
            "pong", max_new_tokens=4))

    threads = [threading.Thread(target=run_openai), threading.Thread(target=run_tgi)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"openai": "pong", "tgi": "pong"}
    running.close()
    server.check_idle()


def _idle_connection_closed_after(url: str, wait: float) -> bool:
    """Send one keep-alive request on a raw socket, stay idle ``wait`` seconds, and say
    whether the server has closed the connection meanwhile."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head
        sock.settimeout(wait)
        try:
            return sock.recv(65536) == b""  # EOF: closed by the server
        except TimeoutError:
            return False


def test_timeout_keep_alive_closes_idle_connections(inproc_server, echo_flags):
    short = inproc_server(**echo_flags, timeout_keep_alive=0.3)
    assert _idle_connection_closed_after(short.url, 3.0)
    longer = inproc_server(**echo_flags, timeout_keep_alive=5.0)
    assert not _idle_connection_closed_after(longer.url, 1.0)
