"""MindIE/Triton ``priority`` and ``timeout`` are real: the dialects pass them to the engine as
GenerateRequest.priority / .deadline, the engine admits priority 1 first and the engine client
finishes (and frees) requests past their deadline. Engine-level tests use a slowed echo backend with one
running slot; the HTTP test checks both dialects' timeout errors."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from echo_backend import EchoBackend

from llmserve.config import ServerConfig
from llmserve.engine.client import EngineClient
from llmserve.engine.engine import LLMEngine
from llmserve.errors import GenerationError
from llmserve.request import GenerateRequest
from llmserve.sampling import SamplingParams

STEP_DELAY = 0.01


class SlowEcho(EchoBackend):
    def step(self, batch):
        time.sleep(STEP_DELAY)
        return super().step(batch)


def make_client(max_num_seqs: int = 1) -> EngineClient:
    config = ServerConfig(block_size=4, num_kv_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                          max_model_len=512, enable_prefix_caching=True, enable_chunked_prefill=True)
    backend = SlowEcho(config)
    return EngineClient(LLMEngine(backend, backend.load(), config))


def request(prompt: str, max_tokens: int, priority: int = 5, deadline: float | None = None) -> GenerateRequest:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(prompt=prompt, sampling=sampling, priority=priority, deadline=deadline)


def test_priority_one_is_admitted_before_earlier_priority_five():
    client = make_client(max_num_seqs=1)
    admitted: list[str] = []

    async def run(name: str, req: GenerateRequest) -> None:
        async for _ in client.generate(client.prepare(req)):
            if name not in admitted:
                admitted.append(name)

    async def main():
        blocker = asyncio.create_task(run("blocker", request("b" * 8, 30)))
        while not admitted:
            await asyncio.sleep(0.005)
        lows = []
        for i in range(4):
            lows.append(asyncio.create_task(run(f"low{i}", request("lo", 2, priority=5))))
            await asyncio.sleep(0.005)  # distinct arrival times, all before the high one
        high = asyncio.create_task(run("high", request("hi", 2, priority=1)))
        await asyncio.gather(blocker, *lows, high)
        assert admitted == ["blocker", "high", "low0", "low1", "low2", "low3"], admitted
        assert await client.check_idle()

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


def test_waiting_request_past_its_timeout_fails_and_frees_everything():
    client = make_client(max_num_seqs=1)

    async def main():
        blocker = request("b" * 8, 40)
        events = []

        async def run_blocker():
            async for event in client.generate(client.prepare(blocker)):
                events.append(event)

        task = asyncio.create_task(run_blocker())
        while not events:
            await asyncio.sleep(0.005)
        start = time.time()
        with pytest.raises(GenerationError) as err:
            late = client.prepare(request("late", 5, deadline=time.monotonic() + 0.1))
            async for _ in client.generate(late):
                pass
        assert err.value.status == 408 and "timed out" in err.value.message
        assert time.time() - start < 0.35  # it did not wait for the blocker to finish
        await task
        assert events[-1].finished
        assert await client.check_idle()

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


def test_running_request_past_its_timeout_is_finished_with_length():
    client = make_client(max_num_seqs=4)

    async def main():
        text, reasons, count = "", [], 0
        running = client.prepare(request("r" * 100, 100, deadline=time.monotonic() + 0.15))
        async for event in client.generate(running):
            for d in event.outputs:
                text += d.text
                count += len(d.token_ids)
                if d.finish_reason:
                    reasons.append(d.finish_reason)
        assert reasons == ["length"] and 0 < count < 100 and text == "r" * count
        assert await client.check_idle()

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


# -- the dialects hand priority and timeout to the engine -------------------------------------
@pytest.fixture
def spied(echo_app):
    client, context = echo_app(served_model_name=["m"])
    seen: list[GenerateRequest] = []
    real = context.engine.generate

    def spy(req):
        seen.append(req)
        return real(req)

    context.engine.generate = spy
    yield client, seen
    context.engine.generate = real


TOKENS = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [104, 105]}]}
TEXT = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}


@pytest.mark.parametrize("path,body,key", [
    ("/v2/models/m/generate", {"text_input": "hi"}, "parameters"),
    ("/v2/models/m/generate_stream", {"text_input": "hi"}, "parameters"),
    ("/v2/models/m/infer", TOKENS, "parameters"),
    ("/v2/models/m/infer", TEXT, "parameters"),
    ("/infer", {"inputs": "hi"}, "parameters"),
    ("/infer", {"inputs": "hi", "stream": True}, "parameters"),
])
def test_dialects_pass_priority_and_deadline(spied, path, body, key):
    client, seen = spied
    before = time.monotonic()  # deadlines are on the monotonic clock
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, key: {"priority": 1, "timeout": 10}}).status_code == 200
    after = time.monotonic()
    default, explicit = seen
    assert default.priority == 5 and before + 600 <= default.deadline <= after + 600
    assert explicit.priority == 1 and before + 10 <= explicit.deadline <= after + 10


def test_timeout_over_http_in_both_dialects(echo_app):
    """One running slot, a long request holding it: requests with timeout=1 s give up while
    waiting, each in its dialect's error format; the engine ends up idle."""
    client, context = echo_app(served_model_name=["m"], max_num_seqs=1)
    backend = context.engine.engine.backend
    real_step = backend.step

    def slow_step(batch):
        time.sleep(STEP_DELAY)
        return real_step(batch)

    backend.step = slow_step
    results: dict[str, object] = {}

    def blocker():
        results["blocker"] = client.post("/infer", json={"inputs": "b" * 250, "parameters": {"max_new_tokens": 250}})

    thread = threading.Thread(target=blocker)
    thread.start()
    deadline = time.time() + 5
    while not context.engine.engine.scheduler.num_running and time.time() < deadline:
        time.sleep(0.01)
    out: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: out.__setitem__("mindie", client.post(
            "/infer", json={"inputs": "late", "parameters": {"timeout": 1, "priority": 5}}))),
        threading.Thread(target=lambda: out.__setitem__("triton", client.post(
            "/v2/models/m/generate", json={"text_input": "late", "parameters": {"timeout": 1}}))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    thread.join(timeout=30)
    mindie, triton = out["mindie"], out["triton"]
    assert mindie.status_code == 424, mindie.text
    assert mindie.json() == {"error": "request timed out before producing output", "error_type": "Generation Error"}
    assert triton.status_code == 408 and triton.json() == {"error": "request timed out before producing output"}
    assert results["blocker"].status_code == 200 and results["blocker"].json()["generated_text"] == "b" * 250
    backend.step = real_step
    assert client.portal.call(context.engine.check_idle)
