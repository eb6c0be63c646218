"""Engine faults, driven by LLMSERVE_FAULT_INJECTION: a failure inside one request fails that
request only; a dead engine loop fails every in-flight request (in-band on streams), turns
/health and /ready to 503, refuses new work, and the server process exits non-zero."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ECHO_PLUGIN, ServerProcess
from llmserve.config import ServerConfig
from llmserve.engine.client import EngineClient
from llmserve.engine.engine import LLMEngine
from llmserve.engine.faults import FaultInjector, InjectedFault
from llmserve.errors import EngineDeadError, GenerationError
from llmserve.request import GenerateRequest
from llmserve.sampling import SamplingParams

from .clients import PROMPT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from echo_backend import EchoBackend

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning")


def test_fault_rules_parse():
    rules = FaultInjector.parse("step:7, request:abc,mask:xyz")
    assert rules.step == 7 and rules.request == ["abc"] and rules.mask == ["xyz"]
    with pytest.raises(InjectedFault):
        rules.check_step(7)
    rules.check_step(6)
    with pytest.raises(InjectedFault):
        rules.check_request("id-abc-1")
    rules.check_request("other")
    assert not FaultInjector.parse("").active
    for bad in ("step", "boom:1", "step:x"):
        with pytest.raises(ValueError):
            FaultInjector.parse(bad)


# -- one request fails, the others go on ------------------------------------------------------------
class MaskingEcho(EchoBackend):
    """The echo backend, asking each sequence's logits mask like the torch sampler does."""

    def step(self, batch):
        for item in batch:
            if item.sample and item.mask is not None:
                item.mask.allowed(list(item.output_ids))
        return super().step(batch)


def engine_client(backend_cls=EchoBackend) -> EngineClient:
    config = ServerConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=128, enable_prefix_caching=True, enable_chunked_prefill=True)
    backend = backend_cls(config)
    return EngineClient(LLMEngine(backend, backend.load(), config))


class BrokenMask:
    def __init__(self, after: int) -> None:
        self.after = after

    def allowed(self, output_ids):
        if len(output_ids) >= self.after:
            raise RuntimeError("mask plugin bug")
        return None


async def run_pair(client, bad: GenerateRequest) -> tuple[str, BaseException | None]:
    good = GenerateRequest(prompt="a healthy neighbour", sampling=SamplingParams(max_tokens=30))

    async def collect(req):
        text = ""
        async for event in client.generate(client.prepare(req)):
            text += "".join(d.text for d in event.outputs)
        return text

    results = await asyncio.gather(collect(good), collect(bad), return_exceptions=True)
    return results[0], results[1] if isinstance(results[1], BaseException) else None


@pytest.mark.parametrize("case", ["mask raises mid-generation", "mask factory raises", "postprocessing raises"])
def test_one_request_fails_alone(case, monkeypatch):
    if case == "postprocessing raises":
        monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "request:doomed")
    client = engine_client(MaskingEcho)
    bad = GenerateRequest(prompt="this one breaks", sampling=SamplingParams(max_tokens=30), request_id="doomed-1")
    if case == "mask raises mid-generation":
        bad.mask_factory = lambda: BrokenMask(after=3)
    elif case == "mask factory raises":
        bad.mask_factory = lambda: (_ for _ in ()).throw(RuntimeError("cannot build"))

    async def main():
        good_text, error = await run_pair(client, bad)
        assert good_text == "a healthy neighbour"
        assert isinstance(error, GenerationError) and not isinstance(error, EngineDeadError)
        assert "see the server log" in error.message and "bug" not in error.message
        assert not client.is_dead
        assert await client.check_idle()

    asyncio.run(main())
    client.shutdown()


def test_request_fault_over_http_fails_that_request_only(server_process):
    server = server_process(*ECHO, env={"LLMSERVE_FAULT_INJECTION": "request:doomed",
                                        "LLMSERVE_ECHO_STEP_DELAY": "0.02"})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    results: dict[str, str] = {}

    def good() -> None:
        results["good"] = client.completions.create(model="echo", prompt="still fine", max_tokens=20).choices[0].text

    thread = threading.Thread(target=good)
    thread.start()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="echo", prompt=PROMPT, max_tokens=20,
                                  extra_headers={"X-Request-Id": "doomed-a"})
    assert err.value.status_code == 500 and err.value.body["type"] == "generation_error"
    stream = client.completions.create(model="echo", prompt=PROMPT, max_tokens=20, stream=True,
                                       extra_headers={"X-Request-Id": "doomed-b"})
    with pytest.raises(openai.APIError, match="generation failed"):
        for _ in stream:
            pass
    thread.join(30)
    assert results == {"good": "still fine"}
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model="echo", prompt="after", max_tokens=5).choices[0].text == "after"


@pytest.mark.slow
def test_mask_fault_on_the_real_model(smollm_inproc):
    """The torch sampler calls the mask inside a batched step; its failure fails one request."""
    server = smollm_inproc
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    results: dict[str, object] = {}

    def good() -> None:
        results["good"] = client.completions.create(model=server.context.model_name, prompt="The capital of France is",
                                                    max_tokens=6, temperature=0).choices[0].finish_reason

    thread = threading.Thread(target=good)
    thread.start()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=server.context.model_name, prompt="Once upon a time", max_tokens=6,
                                  extra_headers={"X-Request-Id": "maskfail-1"})
    assert err.value.body["type"] == "generation_error"
    thread.join(60)
    assert results == {"good": "length"}
    assert not server.context.engine.is_dead
    server.check_idle()


# -- the engine dies --------------------------------------------------------------------------------
def test_dead_engine_fails_everything_and_reports_unhealthy(echo_app, monkeypatch):
    monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "step:3")
    client, context = echo_app(protocols=["ops", "openai", "tgi"])
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"model": "echo", "prompt": PROMPT, "max_tokens": 20})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead_error"
    assert context.engine.is_dead
    assert client.get("/health").status_code == 503
    assert client.get("/ready").status_code == 503
    r = client.post("/v1/completions", json={"model": "echo", "prompt": "new", "max_tokens": 2})
    assert r.status_code == 503 and r.headers.get("retry-after") is None  # dead, not busy: no Retry-After promise
    r = client.post("/generate", json={"inputs": "new", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 503 and r.json()["error_type"] == "generation"


def test_dead_engine_process_exits_nonzero():
    server = ServerProcess(*ECHO, "--trust-request-chat-template",
                           env={"LLMSERVE_FAULT_INJECTION": "step:40", "LLMSERVE_ECHO_STEP_DELAY": "0.02"})
    server.wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        outcome: dict[str, object] = {}

        def non_streaming() -> None:
            try:
                client.completions.create(model="echo", prompt=PROMPT, max_tokens=100)
            except openai.APIStatusError as exc:
                outcome["plain"] = (exc.status_code, exc.body["type"])

        thread = threading.Thread(target=non_streaming)
        thread.start()
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
                "model": "echo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 100, "stream": True,
                "chat_template": "{{ messages[0]['content'] }}"}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        thread.join(30)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "engine_dead_error"
        assert outcome == {"plain": (503, "engine_dead_error")}
        assert server.proc.wait(timeout=30) == 1
    finally:
        log = server.stop()
    assert "engine loop died" in log and "InjectedFault" in log


def test_engine_death_fails_in_flight_queued_and_new_work(monkeypatch):
    monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "step:2")
    client = engine_client()
    deaths: list[BaseException] = []
    client.loop.on_death.append(deaths.append)

    async def main():
        with pytest.raises(EngineDeadError):
            doomed = client.prepare(GenerateRequest(prompt="abcdefgh", sampling=SamplingParams(max_tokens=8)))
            async for _ in client.generate(doomed):
                pass
        assert client.is_dead and len(deaths) == 1 and isinstance(deaths[0], InjectedFault)
        with pytest.raises(EngineDeadError):  # new work fails fast instead of waiting for nobody
            async for _ in client.generate(client.prepare(GenerateRequest(prompt="later"))):
                pass
        with pytest.raises(EngineDeadError):
            client.loop.submit(lambda: None)

    asyncio.run(main())
    client.shutdown()
