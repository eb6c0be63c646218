"""Embeddings, score and rerank on the embedded all-MiniLM-L6-v2 (``--task embed``)."""

import base64
import math
import struct

import pytest


@pytest.fixture(scope="module")
def embed_client():
    from fastapi.testclient import TestClient

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    config, _ = load_config({"task": "embed", "protocols": ["openai", "ops"], "served_model_name": ["mini"],
                             "strict_model_name": True}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_embeddings_float_and_base64_agree_and_are_normalized(embed_client):
    texts = ["The capital of France is Paris.", "A much longer sentence that pads the other one out a lot."]
    floats = embed_client.post("/v1/embeddings", json={"input": texts, "model": "mini"}).json()
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["object"] == "list"
    vec = floats["data"][0]["embedding"]
    assert len(vec) == 384 and abs(math.sqrt(sum(x * x for x in vec)) - 1.0) < 1e-4
    b64 = embed_client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert max(abs(a - b) for a, b in zip(decoded, vec)) < 1e-6
    alone = embed_client.post("/v1/embeddings", json={"input": texts[0]}).json()["data"][0]["embedding"]
    assert max(abs(a - b) for a, b in zip(alone, vec)) < 1e-5  # padding in a batch changes nothing
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 10


def test_score_and_rerank_rank_the_relevant_text_first(embed_client):
    r = embed_client.post("/v1/score", json={"text_1": "What is the capital of France?",
                                             "text_2": ["Bananas are yellow.", "Paris is the capital of France."]})
    scores = [d["score"] for d in r.json()["data"]]
    assert scores[1] > scores[0] + 0.3
    for path, cohere in (("/rerank", False), ("/v1/rerank", False), ("/v2/rerank", True)):
        body = embed_client.post(path, json={"query": "capital of France", "top_n": 2, "documents": [
            "Bananas are yellow.", {"text": "Paris is the capital of France."}, "Cats sleep a lot."]}).json()
        assert [x["index"] for x in body["results"]][0] == 1 and len(body["results"]) == 2
        assert body["results"][0]["document"] == {"text": "Paris is the capital of France."}
        assert ("meta" in body) == cohere


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 10**9]]}, "input"),
    ("/v1/embeddings", {"input": "hello " * 400}, "input"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_2": "a"}, "text_1"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
])
def test_pooling_errors_name_the_param(embed_client, path, body, param):
    r = embed_client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_routes_on_embedding_model(embed_client):
    r = embed_client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == [101, 7592, 2088, 102] and r["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]
    assert embed_client.post("/detokenize", json={"tokens": [7592, 2088]}).json() == {"prompt": "hello world"}
    assert embed_client.get("/tokenizer_info").json()["model_max_length"] == 256
