"""Nothing that grows with the prompt runs on the event loop, and ``/health`` keeps answering
while the largest prompts are in flight.

Two checks:

- **Where the work runs** (in process, echo backend): every route that takes a prompt is
  driven once while the chat-template renderer and the tokenizer record whether they were
  called on the event loop's thread. None may be: that is the rule itself, checked exactly,
  whatever the machine's speed.
- **What a client sees** (real server, real models): a 16 MB prompt (under a raised
  ``--max-prompt-chars``) on each chat route and on ``/v1/embeddings`` while ``/health`` is
  polled every 20 ms: the slowest answer must come within 1 s. The generator's prompts are
  refused at once for their length (no tokenization of SmolLM2's vocabulary can fit 16 MB in
  2048 tokens: ``text/token_floor.py``), after the body was received, parsed, validated and the
  chat template rendered; the embedding model's WordPiece gives no such bound, so its 16 MB is
  tokenized, for seconds, in a tokenizer thread.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from conftest import ServerProcess

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
SHORT = "hello there"
MESSAGES = [{"role": "user", "content": SHORT}]

# Every route that takes prompt text, with a small valid body.
PROMPT_ROUTES = {
    "/v1/chat/completions": {"model": "echo", "messages": MESSAGES, "max_tokens": 4},
    "/v1/completions": {"model": "echo", "prompt": SHORT, "max_tokens": 4},
    "/v1/messages": {"model": "echo", "max_tokens": 4, "messages": MESSAGES},
    "/v1/messages/count_tokens": {"model": "echo", "messages": MESSAGES},
    "/v1/responses": {"model": "echo", "input": SHORT, "max_output_tokens": 16},
    "/api/chat": {"model": "echo", "messages": MESSAGES, "stream": False},
    "/api/generate": {"model": "echo", "prompt": SHORT, "stream": False},
    "/tokenize": {"model": "echo", "prompt": SHORT},
    "/generate": {"inputs": SHORT, "parameters": {"max_new_tokens": 4}},
    "/v2/models/echo/generate": {"text_input": SHORT, "parameters": {"max_tokens": 4}},
    "/infer": {"inputs": SHORT, "stream": False},
}


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("path", list(PROMPT_ROUTES))
def test_prompts_are_rendered_and_tokenized_off_the_event_loop(echo_app, monkeypatch, path):
    import llmserve.text.chat_template as chat_template

    client, context = echo_app(chat_template=TEMPLATE)
    calls: list[tuple[str, bool]] = []
    tokenizer = context.engine.tokenizer
    encode, render = tokenizer.encode, chat_template._render_capped

    def recording_encode(*args, **kwargs):
        calls.append(("encode", _on_loop()))
        return encode(*args, **kwargs)

    def recording_render(*args, **kwargs):
        calls.append(("render", _on_loop()))
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    monkeypatch.setattr(chat_template, "_render_capped", recording_render)
    reply = client.post(path, json=PROMPT_ROUTES[path])
    assert reply.status_code == 200, reply.text
    assert ("encode", False) in calls, calls  # the route did tokenize its prompt ...
    assert not [name for name, on_loop in calls if on_loop], f"{path} ran {calls} on the event loop"  # ... off it


# -- a 16 MB prompt in flight, on real servers ------------------------------------------------
CHARS = 16_000_000  # under the chat template renderer's own cap (16 MiB of output)
CAP = str(2 * CHARS)  # --max-prompt-chars: the prompt must get past the character cap
TEXT = ("The quick brown fox jumps over the lazy dog. " * (CHARS // 45 + 1))[:CHARS]
MAX_LATENCY = 1.0


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


BIG_ROUTES = {
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
        time.sleep(0.1)  # and once more after the reply: nothing left over holds the loop
    finally:
        done.set()
        poller.join(timeout=60)
    return reply, latencies


def check(reply: httpx.Response, latencies: list[float], path: str) -> None:
    # Refused for its length: the whole body was received, parsed and validated.
    # (Anthropic's own wording for it is "prompt is too long: N tokens > M maximum".)
    too_long = "context length" in reply.text or "prompt is too long" in reply.text
    assert reply.status_code == 400 and too_long, (path, reply.status_code, reply.text[:300])
    assert len(latencies) >= 3, (path, latencies)
    assert max(latencies) < MAX_LATENCY, f"{path}: /health took {max(latencies):.2f} s while the prompt was in flight"


@pytest.mark.slow
@pytest.mark.parametrize("path", list(BIG_ROUTES))
def test_health_answers_while_a_16mb_chat_prompt_is_in_flight(generator, path):
    reply, latencies = in_flight(generator.url, path, BIG_ROUTES[path](TEXT))
    print(f"{path}: {len(latencies)} polls, slowest {max(latencies):.3f} s")
    check(reply, latencies, path)
    # Refused from its length, before any tokenizing: the count given is the floor the length
    # proves, far below what tokenizing this text would count (at least one token per 20 chars).
    count = re.search(r"at least (\d+) input tokens|prompt is too long: (\d+) tokens", reply.text)
    assert count and int(count[1] or count[2]) < len(TEXT) // 20, reply.text[:300]


@pytest.mark.slow
def test_health_answers_while_a_16mb_embedding_input_is_tokenized(embedder):
    reply, latencies = in_flight(embedder.url, "/v1/embeddings", {"model": "m", "input": TEXT})
    print(f"/v1/embeddings: {len(latencies)} polls, slowest {max(latencies):.3f} s")
    check(reply, latencies, "/v1/embeddings")
