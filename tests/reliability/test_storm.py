"""Cancellation storm on the real SmolLM2: 200 requests across every dialect, a random share
of them dropped by their client at a random point (before the answer, mid-stream, or while
queued), then the engine must be idle with every KV block free, and still answer."""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import pytest

from .clients import generation_routes, raw_request

pytestmark = pytest.mark.slow

PROMPTS = ["Tell me about the sea.", "List three colours:", "The history of Rome began", "Write a haiku about",
           "def fibonacci(n):", "Once upon a time"]


async def one(url_host: str, port: int, rng: random.Random, routes: list) -> str:
    name, path, body, streams = rng.choice(routes)
    reader, writer = await asyncio.open_connection(url_host, port)
    writer.write(raw_request(path, body, close=True))
    await writer.drain()
    mode = rng.choices(["complete", "drop_before_answer", "drop_mid_answer"], weights=[2, 1, 1])[0]
    try:
        if mode == "complete":
            data = await asyncio.wait_for(reader.read(-1), 300)  # Connection: close -> EOF ends it
            assert data.startswith(b"HTTP/1.1 200"), (name, data[:300])
        elif mode == "drop_before_answer":
            await asyncio.sleep(rng.uniform(0.0, 1.0))
        else:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 300)
            await asyncio.sleep(rng.uniform(0.0, 0.5))
    finally:
        writer.close()
    return mode


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def test_cancellation_storm_leaves_the_engine_idle(smollm_inproc):
    server = smollm_inproc
    errors = Errors()  # the server must not log a single unhandled error (uvicorn's or ours)
    for name in ("uvicorn.error", "llmserve"):
        logging.getLogger(name).addHandler(errors)
    model = server.context.model_name
    rng = random.Random(1234)
    routes = []
    for prompt in PROMPTS:
        for route in generation_routes(prompt=prompt, max_tokens=rng.choice([4, 8, 12]), model=model):
            name, path, body, streams = route
            if "infer-2-texts" in name:  # Triton text infer needs the served name in the path
                path = f"/v2/models/{model}/infer"
            routes.append((name, path, body, streams))

    async def storm() -> list[str]:
        sem = asyncio.Semaphore(48)

        async def limited(i: int) -> str:
            async with sem:
                return await one("127.0.0.1", server.port, random.Random(rng.random()), routes)

        return await asyncio.gather(*(limited(i) for i in range(200)))

    try:
        modes = asyncio.run(storm())
    finally:
        for name in ("uvicorn.error", "llmserve"):
            logging.getLogger(name).removeHandler(errors)
    assert errors.records == []
    assert {"complete", "drop_before_answer", "drop_mid_answer"} <= set(modes)
    server.check_idle(timeout=60)
    assert server.engine.block_manager.num_free_blocks == server.engine.block_manager.num_blocks
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
