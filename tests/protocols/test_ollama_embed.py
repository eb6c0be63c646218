"""The ``ollama`` client's ``embed`` and legacy ``embeddings`` against a real ``--task embed``
server on the embedded all-MiniLM-L6-v2 (strict model names)."""

from __future__ import annotations

import math

import ollama
import pytest

from conftest import EMBED_TEXTS, embed_server

pytestmark = pytest.mark.slow

TEXTS = EMBED_TEXTS


@pytest.fixture(scope="module")
def client():
    with embed_server("ollama,openai,ops") as server:
        yield ollama.Client(host=server.url, timeout=120)


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_embed_batch_single_and_legacy(client):
    reply = client.embed(model="mini:latest", input=TEXTS)
    assert reply.model == "mini:latest" and len(reply.embeddings) == 2
    assert all(len(v) == 384 and norm(v) == pytest.approx(1.0, abs=1e-4) for v in reply.embeddings)
    assert reply.prompt_eval_count > 10
    one = client.embed(model="mini", input=TEXTS[0]).embeddings[0]
    assert max(abs(a - b) for a, b in zip(one, reply.embeddings[0])) < 1e-5
    legacy = client.embeddings(model="mini", prompt=TEXTS[0]).embedding
    assert max(abs(a - b) for a, b in zip(legacy, one)) < 1e-5
    # Related texts are closer than unrelated ones.
    query = client.embed(model="mini", input="Which city is the capital of France?").embeddings[0]
    near, far = (sum(a * b for a, b in zip(query, v)) for v in reply.embeddings)
    assert near > far
    assert client.list().models[0].model == "mini:latest" and client.show("mini").capabilities == ["embedding"]


def test_dimensions_and_truncate(client):
    full = client.embed(model="mini", input=TEXTS[0]).embeddings[0]
    short = client.embed(model="mini", input=TEXTS[0], dimensions=64).embeddings[0]
    assert len(short) == 64 and norm(short) == pytest.approx(1.0, abs=1e-5)
    scale = norm(full[:64])
    assert max(abs(a - b / scale) for a, b in zip(short, full[:64])) < 1e-5
    long_text = "word " * 400  # more tokens than the context, fewer characters than --max-prompt-chars
    assert len(client.embed(model="mini", input=long_text).embeddings[0]) == 384  # cut to the context
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="mini", input=long_text, truncate=False)
    assert info.value.status_code == 400 and "context length" in info.value.error


def test_errors(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="other", input="x")
    assert info.value.status_code == 404 and info.value.error == 'model "other" not found, try pulling it first'
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="mini", input="x", dimensions=1000)
    assert info.value.status_code == 400 and "dimensions" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="mini", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400 and "embedding model" in info.value.error
    assert client.embed(model="mini", input=[]).embeddings == []
