"""A cancelled ``generate()`` always stops and aborts its request, whenever the cancellation
lands relative to the engine's events, with or without a deadline.

The server aborts a request whose client left by cancelling the route's task once (the
request guard); ``generate()`` must not lose that cancellation. The race the HTTP tests hit
only now and then (a cancellation in the same few event-loop turns as an arriving event,
which Python 3.10/3.11's ``asyncio.wait_for`` swallows) is made exact here: the cancellation
is issued 0 to 5 loop turns after an engine event is queued, every time.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from echo_backend import EchoBackend

from llmserve.config import ServerConfig
from llmserve.engine.client import EngineClient
from llmserve.engine.engine import LLMEngine
from llmserve.request import GenerateRequest
from llmserve.request_context import RequestContext, reset_context, set_context
from llmserve.sampling import SamplingParams

STEP = 0.01
PROMPT = "the quick brown fox jumps over the lazy dog " * 3  # the echo backend: ~130 output tokens
TURNS = range(6)  # loop turns between an event being queued and the cancellation


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", str(STEP))
    config = ServerConfig(block_size=4, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256,
                          max_model_len=512, enable_prefix_caching=True, enable_chunked_prefill=True)
    backend = EchoBackend(config)
    engine_client = EngineClient(LLMEngine(backend, backend.load(), config))
    yield engine_client
    engine_client.shutdown()


def cancel_after_event(loop: asyncio.AbstractEventLoop, task: asyncio.Task, event_no: int, turns: int) -> None:
    """Cancel ``task`` ``turns`` loop turns after the engine queued its ``event_no``-th event.

    Engine events reach the loop through ``call_soon_threadsafe(queue.put_nowait, event)``;
    the wrapper counts those and schedules the cancellation right behind the chosen one."""
    original = loop.call_soon_threadsafe
    seen = 0

    def later(left: int) -> None:
        if left:
            loop.call_soon(later, left - 1)
        else:
            task.cancel()

    def wrapped(callback: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(callback, "__name__", "") != "put_nowait":
            return original(callback, *args, **kwargs)

        def deliver() -> None:
            nonlocal seen
            callback(*args)
            seen += 1
            if seen == event_no:
                later(turns)
        return original(deliver, **kwargs)

    loop.call_soon_threadsafe = wrapped  # type: ignore[method-assign]


@pytest.mark.parametrize("deadline", ["none", "request", "server"])
def test_cancelled_generate_aborts_whenever_the_cancellation_lands(client, deadline):
    """``request``: the request's own deadline (Triton's and MindIE's ``timeout``, 600 s by
    default); ``server``: ``--request-timeout`` on the request context."""

    async def consume(request: GenerateRequest, events: list) -> None:
        ctx = RequestContext("r", time.monotonic())
        if deadline == "server":
            ctx.deadline = time.monotonic() + 600
        token = set_context(ctx)
        try:
            async for event in client.generate(client.prepare(request)):
                events.append(event)
        finally:
            reset_context(token)

    async def one(turns: int) -> None:
        loop = asyncio.get_running_loop()
        request = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=300, ignore_eos=True),
                                  deadline=time.monotonic() + 600 if deadline == "request" else None)
        events: list = []
        task = asyncio.create_task(consume(request, events))
        cancel_after_event(loop, task, event_no=3, turns=turns)
        try:
            await asyncio.wait({task}, timeout=30)
        finally:
            del loop.call_soon_threadsafe  # back to the loop's own method
        assert task.done(), f"{turns} turns: generate() still running 30 s after the cancel"
        assert task.cancelled(), (f"{turns} turns: generate() lost the cancellation and ran to its end "
                                  f"({len(events)} events)")
        steps = client.engine.stats["steps"]
        end = time.monotonic() + 10
        while client.engine.requests:  # the abort is queued for the engine thread's next poll
            assert time.monotonic() < end, f"{turns} turns: the request is still in the engine"
            await asyncio.sleep(STEP / 4)
        assert client.engine.stats["steps"] - steps <= 2, f"{turns} turns: not aborted within a step"
        assert await client.check_idle()

    async def main() -> None:
        for turns in TURNS:
            await one(turns)

    asyncio.run(main())
