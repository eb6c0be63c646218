"""A hybrid model (Qwen3.5's shape: Gated DeltaNet layers with a recurrent state per sequence)
through a cancellation storm: requests of every dialect, a random share dropped by their client
before or during the answer or while queued for one of four state slots; then every block and
every state slot is free (the engine's own idle check covers both), ``/metrics`` says so, and the
model still answers exactly as transformers does."""

from __future__ import annotations

import asyncio
import os
import random
import sys

import httpx

from .clients import ECHO_TEMPLATE, generation_routes
from .test_storm import one

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import hybrid_model

PROMPT = "t23 t45 t67 t89 t32 t54 t76 t98 t24 t46"


def test_a_storm_leaves_every_state_slot_free(inproc_server, tmp_path) -> None:
    reference = hybrid_model.write_hybrid("qwen3_5_text", str(tmp_path))
    server = inproc_server(model=str(tmp_path), dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256,
                           trust_request_chat_template=True)
    model = server.context.model_name
    routes = []
    for route in generation_routes(prompt=PROMPT, max_tokens=12, model=model):
        name, path, body, streams = route
        if "messages" in body:  # the word tokenizer has no chat template of its own
            body = {**body, "chat_template": ECHO_TEMPLATE}
        routes.append((name, f"/v2/models/{model}/infer" if "infer-2-texts" in name else path, body, streams))
    rng = random.Random(77)

    async def storm() -> list[str]:
        sem = asyncio.Semaphore(16)

        async def limited() -> str:
            async with sem:
                return await one("127.0.0.1", server.port, random.Random(rng.random()), routes)

        return await asyncio.gather(*(limited() for _ in range(60)))

    modes = asyncio.run(storm())
    assert {"complete", "drop_before_answer", "drop_mid_answer"} <= set(modes)
    server.check_idle(timeout=60)
    assert server.engine.snapshot().state_slots_total == 4
    scrape = httpx.get(server.url + "/metrics", timeout=30).text
    assert f'llmserve:state_slots_used{{model_name="{model}"}} 0.0' in scrape
    assert f'llmserve:state_slots_total{{model_name="{model}"}} 4.0' in scrape
    ids = [int(w[1:]) for w in PROMPT.split()]
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["text"].split()
    assert [int(w[1:]) for w in answer] == hybrid_model.reference_generate(reference, ids, 8)
