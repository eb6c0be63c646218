"""A prompt of several megabytes (under a raised ``--max-prompt-chars``) is rendered and tokenized
off the event loop on every chat route and on the pooling routes: while one is in flight,
``/health`` keeps answering, on the real embedded models and their real tokenizers.

Each big request is refused once tokenized (it is longer than the context), which proves it
was tokenized; the poller asks ``/health`` every 20 ms throughout and the slowest answer must
come within 1 s. Tokenizing 4 MB takes seconds on a 2-core machine, so a route that tokenized
on the event loop would hold ``/health`` for all of that; an answer within 1 s leaves a wide
margin over what a free loop needs (milliseconds) whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow

CHARS = 4_000_000
CAP = str(4 * CHARS)  # --max-prompt-chars: the prompt must reach the tokenizer
TEXT = ("The quick brown fox jumps over the lazy dog. " * (CHARS // 45 + 1))[:CHARS]
MAX_LATENCY = 1.0


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


ROUTES = {
    "/v1/chat/completions": chat,
    "/v1/messages": chat,
    "/v1/responses": lambda text: {"model": "m", "input": text, "max_output_tokens": 16},
    "/api/chat": lambda text: {"model": "m", "messages": [{"role": "user", "content": text}], "stream": False},
    "/api/generate": lambda text: {"model": "m", "prompt": text, "stream": False},
}


@pytest.fixture(scope="module")
def generator():
    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--max-prompt-chars",
                           CAP, "--protocols", "openai,anthropic,responses,ollama,ops", "--log-level", "warning")
    try:
        yield server.wait_ready(timeout=300)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def embedder():
    server = ServerProcess("--task", "embed", "--max-prompt-chars", CAP, "--protocols", "openai,ops",
                           "--log-level", "warning")
    try:
        yield server.wait_ready(timeout=300)
    finally:
        server.stop()


def in_flight(url: str, path: str, body: dict) -> tuple[httpx.Response, list[float]]:
    """POST ``body`` while polling ``/health`` from a thread; the reply and every poll's latency."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            client.get("/health")  # a warm connection: what is measured is the server's answer
            while not done.is_set():
                start = time.perf_counter()
                status = client.get("/health").status_code
                latencies.append(time.perf_counter() - start if status == 200 else float("inf"))
                time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.1)
    try:
        reply = httpx.post(url + path, json=body, timeout=300)
    finally:
        done.set()
        poller.join(timeout=60)
    return reply, latencies


def check(reply: httpx.Response, latencies: list[float], path: str) -> None:
    # Refused for its length once tokenized: the prompt did reach the tokenizer.
    assert reply.status_code == 400 and "context length" in reply.text, (path, reply.status_code, reply.text[:300])
    assert len(latencies) >= 3, (path, latencies)
    assert max(latencies) < MAX_LATENCY, f"{path}: /health took {max(latencies):.2f} s while the prompt was in flight"


@pytest.mark.parametrize("path", list(ROUTES))
def test_health_answers_while_a_chat_prompt_is_tokenized(generator, path):
    reply, latencies = in_flight(generator.url, path, ROUTES[path](TEXT))
    print(f"{path}: {len(latencies)} polls, slowest {max(latencies):.3f} s")
    check(reply, latencies, path)


@pytest.mark.parametrize("path", ["/v1/embeddings"])
def test_health_answers_while_an_embedding_input_is_tokenized(embedder, path):
    reply, latencies = in_flight(embedder.url, path, {"model": "m", "input": TEXT})
    print(f"{path}: {len(latencies)} polls, slowest {max(latencies):.3f} s")
    check(reply, latencies, path)
