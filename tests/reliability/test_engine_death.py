"""The engine dying while it admits a request (``LLMSERVE_FAULT_INJECTION=add:...``): the request
that killed it gets the engine's death as its answer, in its own dialect's format, like every
other request in flight; and the server process exits 1 within a couple of seconds even while
a client holds a stream open without ever reading it."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from conftest import ECHO_PLUGIN, ServerProcess

from .clients import ECHO_TEMPLATE, PROMPT, generation_routes, raw_request

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning")


def engine_dead_answer(name: str, response: httpx.Response) -> str:
    """The error text of an answer that reports the engine's death in the route's own format:
    a 503 before the reply started, or an in-band error event after it."""
    text = response.text
    if response.status_code == 503:
        body = response.json()
        error = body["error"]
        if name.startswith(("openai", "vllm")):  # OpenAI's envelope (vLLM-native answers in it too)
            assert error["type"] == "engine_dead_error", body
            return error["message"]
        if name.startswith("tgi"):
            assert body["error_type"] == "generation", body
        return error if isinstance(error, str) else json.dumps(error)
    assert response.status_code == 200, (name, response.status_code, text)
    assert "error" in text and "restarting" in text, (name, text[-500:])
    return text


@pytest.mark.parametrize("name, path, body, streams", generation_routes(max_tokens=40),
                         ids=[r[0] for r in generation_routes()])
def test_the_request_that_kills_the_engine_is_answered(inproc_server, echo_flags, monkeypatch, name, path, body,
                                                       streams):
    # The second request queued kills the engine: the first is a stream in flight at that moment.
    monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "add:#2")
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", "0.02")
    server = inproc_server(**echo_flags)
    first: dict[str, str] = {}
    started = threading.Event()

    def in_flight() -> None:
        chat = {"model": "echo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200,
                "stream": True, "chat_template": ECHO_TEMPLATE}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=30) as r:
            lines = []
            for line in r.iter_lines():
                started.set()
                lines.append(line)
            first["text"] = "\n".join(lines)

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert started.wait(30)
    r = httpx.post(server.url + path, json=body, timeout=30)  # must not hang: it is answered
    thread.join(30)
    assert "restarting" in engine_dead_answer(name, r)
    assert '"engine_dead_error"' in first["text"] and first["text"].rstrip().endswith("data: [DONE]")
    assert server.context.engine.is_dead


def test_process_exits_within_two_seconds_while_a_client_never_reads():
    server = ServerProcess(*ECHO, "--trust-request-chat-template", "--max-model-len", "8192",
                           env={"LLMSERVE_FAULT_INJECTION": "add:doomed"})
    server.wait_ready()
    port = int(server.url.rsplit(":", 1)[1])
    stalled = socket.socket()
    try:
        # A stream big enough to fill both socket buffers, from a client that never reads: the
        # server's writes block, so this response can never complete.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(raw_request("/v1/completions", {
            "model": "echo", "prompt": "x" * 6000, "max_tokens": 2000, "n": 16, "temperature": 1.0,
            "logprobs": 20, "stream": True}))
        time.sleep(3.0)  # megabytes of events: both buffers are full long before this
        assert server.proc.poll() is None
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "doomed-1"}, timeout=30,
                       json={"model": "echo", "prompt": PROMPT, "max_tokens": 20})
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead_error", r.text
        code = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        stalled.close()
        log = server.stop()
    assert code == 1, log
    assert elapsed < 3.0, (elapsed, log)  # the promise is 2 s; the margin is for a loaded test machine
    assert "engine loop died" in log and "while adding request doomed-1" in log
