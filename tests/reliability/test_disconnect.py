"""A client that goes away has its request aborted and its KV blocks freed: streaming or not,
running or still waiting, any n, in every dialect. Real uvicorn on loopback, echo backend
slowed to 100 ms per step so requests are caught mid-generation; the engine's own idle
invariant (no request records, every block free) is the proof."""

from __future__ import annotations

import time

import pytest

from .clients import Dropped, generation_routes

ROUTES = generation_routes()
STEP = 0.1


@pytest.fixture
def slow_echo(inproc_server, echo_flags, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", str(STEP))
    return inproc_server(**echo_flags, max_num_seqs=4)


def wait_requests(server, count: int, timeout: float = 20.0) -> None:
    end = time.time() + timeout
    while len(server.engine.requests) != count:
        assert time.time() < end, f"engine holds {len(server.engine.requests)} requests, expected {count}"
        time.sleep(0.01)


@pytest.mark.parametrize("name,path,body,streams", ROUTES, ids=[r[0] for r in ROUTES])
def test_running_request_is_aborted_within_a_step(slow_echo, name, path, body, streams):
    server = slow_echo
    prompts = 2 if "2-prompts" in name or "2-texts" in name else 1
    client = Dropped(server.url, path, body)
    if streams:
        client.read_some(b"\r\n\r\n")  # headers: the stream is running
    wait_requests(server, prompts)
    time.sleep(4 * STEP)  # a few decode steps in
    assert len(server.engine.requests) == prompts, "the request finished before the test could drop it"
    steps_at_close = server.engine.stats["steps"]
    client.close()
    wait_requests(server, 0)
    # The abort lands between two steps: at most the step running at close time, plus one if
    # the abort command arrived just after the loop had collected its commands.
    assert server.engine.stats["steps"] - steps_at_close <= 2
    server.check_idle()


WAITING = [r for r in ROUTES if r[0] in ("openai-chat", "tgi-generate-stream", "vllm-generate", "mindie-infer",
                                        "triton-generate-stream")]


@pytest.mark.parametrize("name,path,body,streams", WAITING, ids=[r[0] for r in WAITING])
def test_waiting_request_is_dropped_from_the_queue(inproc_server, echo_flags, monkeypatch, name, path, body,
                                                   streams):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", str(STEP))
    server = inproc_server(**echo_flags, max_num_seqs=1)
    holder = Dropped(server.url, "/v1/completions", {"prompt": "x" * 300, "max_tokens": 150, "stream": True})
    holder.read_some(b"data:")  # running: it owns the only batch slot
    waiting = Dropped(server.url, path, body)
    wait_requests(server, 2)
    assert server.engine.scheduler.num_waiting == body.get("n", 1)  # every sequence of it waits
    waiting.close()
    wait_requests(server, 1)  # the waiting one is gone, the running one goes on
    assert server.engine.scheduler.num_waiting == 0 and server.engine.scheduler.num_running == 1
    holder.close()
    server.check_idle()
