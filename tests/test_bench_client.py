"""The serving benchmark's own HTTP client (bench/serve_bench.py): it decodes chunked SSE
responses by hand, so check it against a real server: token counts from usage, one TTFT per
request, keep-alive reuse across requests, and a clear error on a refused request. Also its
plain ``model.generate`` reference (the concurrency-1 baseline) on a tiny model."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from conftest import ECHO_PLUGIN, ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "bench"))  # the scripts import each other by name
        spec.loader.exec_module(module)
    return module


def test_level_counts_tokens_and_reuses_connections(bench, server_process, monkeypatch):
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--served-model-name", "echo")
    opened = []
    real_open = asyncio.open_connection

    async def counting_open(*args, **kwargs):
        opened.append(args)
        return await real_open(*args, **kwargs)

    monkeypatch.setattr(asyncio, "open_connection", counting_open)
    row = asyncio.run(bench.run_level(server.url, "echo", concurrency=3, total=7, max_tokens=9,
                                      extra={"ignore_eos": True}))
    assert row["requests"] == 7 and row["tokens"] == 7 * 9
    assert len(row["ttft"]) == 7 and all(0 < t < 60 for t in row["ttft"])
    assert len(row["itl"]) == 7 * 8  # one gap between each pair of a request's 9 text events
    assert len(opened) == 3  # one keep-alive connection per worker


def test_refused_request_raises_with_the_status(bench, server_process):
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--served-model-name", "echo")
    with pytest.raises(RuntimeError, match="HTTP 4"):
        asyncio.run(bench.run_level(server.url, "echo", concurrency=1, total=1, max_tokens=-3, extra={}))


def test_plain_generate_times_exactly_max_tokens_per_prompt(bench, tmp_path):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("paged_tests", ROOT / "tests" / "backends" / "test_torch_paged.py")
    paged_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paged_tests)
    paged_tests.build_tiny_model(str(tmp_path))
    # Make EOS the very first greedy pick for the measured prompts: the loop must still run
    # every request to max_tokens, as the servers do with ignore_eos.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.inference_mode():
        firsts = {int(model(**tok(p, return_tensors="pt")).logits[0, -1].argmax()) for p in bench.PROMPTS[1:3]}
    GenerationConfig(eos_token_id=sorted(firsts)).save_pretrained(str(tmp_path))
    row = bench.plain_generate(str(tmp_path), "float32", "cpu", max_tokens=6, runs=2)
    assert row["tokens"] == 2 * 6
    assert row["wall_s"] > 0 and row["tok_s"] == pytest.approx(row["tokens"] / row["wall_s"])
