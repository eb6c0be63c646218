"""The official ``openai`` client's embeddings against a real ``--task embed`` server on the
embedded all-MiniLM-L6-v2; score and rerank (no client method) through httpx."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from conftest import EMBED_TEXTS, embed_server

pytestmark = pytest.mark.slow

TEXTS = EMBED_TEXTS


@pytest.fixture(scope="module")
def url():
    # Strict names: an unknown model is a 404 (the lenient default is tests/protocols/test_model_names.py's).
    with embed_server("openai,ops") as server:
        yield server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_embeddings_default_base64_matches_float(client):
    # Without encoding_format the client asks for base64 and decodes it to floats itself.
    default = client.embeddings.create(model="mini", input=TEXTS)
    floats = client.embeddings.create(model="mini", input=TEXTS, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1] and default.model == "mini"
    for a, b in zip(default.data, floats.data):
        assert len(a.embedding) == len(b.embedding) == 384
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
        assert math.sqrt(sum(x * x for x in b.embedding)) == pytest.approx(1.0, abs=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # One text alone embeds as it does inside a batch.
    one = client.embeddings.create(model="mini", input=TEXTS[0], encoding_format="float").data[0].embedding
    assert max(abs(x - y) for x, y in zip(one, floats.data[0].embedding)) < 1e-5


def test_embeddings_errors_are_client_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="mini", input=TEXTS, dimensions=12)
    assert info.value.param == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=TEXTS)


def test_score_and_rerank_over_http(url):
    query = "Which city is the capital of France?"
    score = httpx.post(url + "/score", json={"model": "mini", "text_1": query, "text_2": TEXTS}).json()
    values = [d["score"] for d in score["data"]]
    assert [d["index"] for d in score["data"]] == [0, 1] and values[0] > values[1]
    assert all(-1.0 <= v <= 1.0 for v in values)
    rerank = httpx.post(url + "/v1/rerank", json={"model": "mini", "query": query, "documents": TEXTS,
                                                  "top_n": 1}).json()
    assert [r["index"] for r in rerank["results"]] == [0]
    assert rerank["results"][0]["relevance_score"] == pytest.approx(values[0], abs=1e-5)
    assert rerank["results"][0]["document"] == {"text": TEXTS[0]}
    bad = httpx.post(url + "/rerank", json={"query": query, "documents": TEXTS, "top_n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"
