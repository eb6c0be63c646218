"""SIGTERM on a real server process (echo backend, 50 ms per step): admission closes (503, TGI
429, /ready 503) while the socket stays open, in-flight requests finish within
--shutdown-timeout, the rest are aborted (in-band error on streams), and the exit code is 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from text_generation import Client as TGIClient
from text_generation.errors import OverloadedError

from conftest import ECHO_PLUGIN, ServerProcess

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning")
SLOW = {"LLMSERVE_ECHO_STEP_DELAY": "0.05"}


def start(*flags: str) -> ServerProcess:
    return ServerProcess(*ECHO, *flags, env=SLOW).wait_ready()


def in_background(server: ServerProcess, max_tokens: int) -> tuple[list[threading.Thread], dict]:
    """One non-streaming and one streaming completion, each in a thread; results land in the dict."""
    out: dict = {}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    def plain() -> None:
        try:
            res = client.completions.create(model="echo", prompt="y" * 200, max_tokens=max_tokens)
            out["plain"] = (res.choices[0].finish_reason, len(res.choices[0].text))
        except openai.APIStatusError as exc:
            out["plain"] = (exc.status_code, exc.body["type"])

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": "echo", "prompt": "z" * 200, "max_tokens": max_tokens, "stream": True}) as r:
            out["stream"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    return threads, out


def wait_in_flight(server: ServerProcess, count: int) -> None:
    end = time.time() + 20
    while f'vllm:num_requests_running{{model_name="echo"}} {count}.0' not in httpx.get(server.url + "/metrics").text:
        assert time.time() < end, "requests did not start"
        time.sleep(0.05)


def wait_draining(server: ServerProcess) -> None:
    end = time.time() + 10
    while httpx.get(server.url + "/ready").status_code != 503:
        assert time.time() < end, "the server never started draining"
        time.sleep(0.02)


def test_sigterm_drains_in_flight_requests_then_exits_0():
    server = start("--shutdown-timeout", "30")
    try:
        threads, out = in_background(server, max_tokens=40)  # about 2 s each
        wait_in_flight(server, 2)
        server.proc.send_signal(signal.SIGTERM)
        wait_draining(server)
        assert httpx.get(server.url + "/ready").json()["reason"] == "draining"
        # New work is refused in each dialect's words while the old work finishes.
        with pytest.raises(openai.InternalServerError) as err:
            openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).completions.create(
                model="echo", prompt="late", max_tokens=2)
        assert err.value.status_code == 503 and "shutting down" in err.value.message
        assert err.value.response.headers["retry-after"]
        with pytest.raises(OverloadedError):
            TGIClient(server.url, timeout=10).generate("late", max_new_tokens=2)
        for t in threads:
            t.join(60)
        assert out["plain"] == ("length", 40)
        assert out["stream"][-1] == "[DONE]"
        assert json.loads(out["stream"][-2])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("timeout", ["0.5", "0"])
def test_shutdown_timeout_aborts_the_rest_and_exits_0(timeout):
    server = start("--shutdown-timeout", timeout)
    try:
        threads, out = in_background(server, max_tokens=200)  # about 10 s: far past the timeout
        wait_in_flight(server, 2)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert out["plain"] == (503, "unavailable_error")
        assert out["stream"][-1] == "[DONE]"
        error = json.loads(out["stream"][-2])["error"]
        assert error["type"] == "unavailable_error" and "shutting down" in error["message"]
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
