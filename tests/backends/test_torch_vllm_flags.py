"""vLLM's ``--tokenizer`` and ``--seed`` on the torch backend, end to end on a tiny random Llama."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient

from llmserve.config import load_config
from llmserve.errors import ConfigError
from llmserve.hooks.manager import PluginManager
from llmserve.server.serve import build_server
from test_torch_paged import build_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model(path)
    return path


def serve(**flags):
    """A started in-process server on the torch backend (a context manager yielding its client)."""
    flags = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "num_kv_blocks": 64, **flags}
    config, _ = load_config(flags, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    return TestClient(app, raise_server_exceptions=False)


def complete(client: TestClient, **extra) -> str:
    reply = client.post("/v1/completions", json={"model": "m", "prompt": "t5 t6 t7", "max_tokens": 8,
                                                 "temperature": 1.0, "ignore_eos": True, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_tokenizer_from_another_directory(tiny_dir, tmp_path):
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    shutil.copytree(tiny_dir, model_dir)
    tokenizer_dir.mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.move(str(model_dir / name), tokenizer_dir / name)
    with pytest.raises(ConfigError, match="cannot load the tokenizer of model"):
        serve(model=str(model_dir))
    with serve(model=str(model_dir), tokenizer=str(tokenizer_dir)) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "t5 t6 t7", "max_tokens": 8,
                                                     "ignore_eos": True, "return_token_ids": True}).json()
    choice = reply["choices"][0]
    assert reply["usage"]["completion_tokens"] == 8 and len(choice["token_ids"]) == 8
    # The other directory's word-level vocabulary decodes the ids (its special tokens t0 and t1
    # are skipped in the text, so a sampled one leaves a word out).
    want = [f"t{i}" for i in choice["token_ids"] if i > 1]
    assert choice["text"].split() == want


def test_tokenizer_directory_must_exist(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match=f"cannot load tokenizer '{Path(tmp_path, 'none')}'"):
        serve(model=tiny_dir, tokenizer=str(tmp_path / "none"))


def test_seed_makes_unseeded_requests_reproducible_across_restarts(tiny_dir):
    runs = []
    for _ in range(2):  # a restart: a new server with the same --seed
        with serve(model=tiny_dir, seed=1234) as client:
            runs.append([complete(client) for _ in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]  # each request draws its own seed
    with serve(model=tiny_dir) as client:
        assert complete(client) != runs[0][0]  # without --seed, sampling is not reproducible
        with_own = complete(client, seed=99)
    with serve(model=tiny_dir, seed=1234) as client:
        assert complete(client, seed=99) == with_own  # a request's own seed is its own


def counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name))


def test_a_draft_model_speculates_and_one_of_another_vocabulary_is_refused(tiny_dir):
    """vLLM's ``--speculative-config '{"method": "draft", "model": ...}'`` through the server's own
    loader: the tiny model as its own draft proposes what it then picks (every proposal stands,
    the answer is the plain one); the embedded SmolLM2 as the draft is refused at start."""
    from llmserve.plugins.backends.torch.loader import embedded_model_path

    body = {"model": "m", "prompt": "t5 t6 t7", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with serve(model=tiny_dir) as client:
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with serve(model=tiny_dir, speculative_config={"method": "draft", "model": tiny_dir}) as client:
        reply = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        metrics = client.get("/metrics").text
    assert reply == plain
    proposed = counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    assert proposed > 8 and counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") == proposed
    with pytest.raises(ConfigError, match="the draft model .* has another vocabulary than .*; a draft must share"):
        serve(model=tiny_dir, speculative_config={"method": "draft", "model": embedded_model_path()})
