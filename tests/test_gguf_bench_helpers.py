"""The pure helpers of the GGUF benchmark (bench/gguf_bench.py, bench/llama_cpp.py): the bytes a
decode step reads (from GGUF metadata and from a config.json), the single-stream ceiling they
give, where llama.cpp binaries are found, and the result table. Nothing here builds llama.cpp
or starts a server."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import ROOT


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the scripts import each other by name
    import gguf_bench

    return gguf_bench


def write_gguf(path, layers: int, kv_heads: int, embd: int, heads: int, tensor_bytes: int) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count_kv(kv_heads)
    writer.add_embedding_length(embd)
    writer.add_head_count(heads)
    writer.add_tensor("token_embd.weight", np.zeros(tensor_bytes // 4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_kv_bytes_from_gguf_metadata_and_config(bench, tmp_path):
    # 3 layers x 2 KV heads x head_dim 16 (embedding 64 over 4 heads) x K and V x 2 bytes
    write_gguf(tmp_path / "m.gguf", layers=3, kv_heads=2, embd=64, heads=4, tensor_bytes=4096)
    assert bench.kv_bytes_per_position(tmp_path / "m.gguf") == 2 * 3 * 2 * 16 * 2
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_hidden_layers": 16, "num_key_value_heads": 8,
                                                "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 64}))
    (hf / "model.safetensors").write_bytes(b"\0" * 1000)
    (hf / "notes.txt").write_bytes(b"\0" * 99)  # not weights
    assert bench.kv_bytes_per_position(hf) == 2 * 16 * 8 * 64 * 2
    assert bench.weight_bytes(hf) == 1000


def test_kv_bytes_of_layers_of_two_shapes(bench, tmp_path):
    """Gemma 4 (tests/gemma4_model.py's e2b shape): two sliding layers of 2 heads of 16 and a
    global one of 2 heads of 32 keep keys; the last three read them and keep none. The same
    count from the GGUF file's per-layer metadata and from the model's config."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import gemma4_gguf
    import gemma4_model

    want = (2 * 2 * 16 * 2 + 2 * 2 * 32) * 2
    gemma4_gguf.write_gemma4_gguf(str(tmp_path / "g.gguf"), "e2b")
    assert bench.kv_bytes_per_position(tmp_path / "g.gguf") == want
    gemma4_model.write_gemma4("e2b", str(tmp_path / "g"))
    assert bench.kv_bytes_per_position(tmp_path / "g") == want


def test_limit_is_bandwidth_over_bytes_per_step(bench, tmp_path):
    write_gguf(tmp_path / "m.gguf", layers=2, kv_heads=1, embd=32, heads=2, tensor_bytes=1 << 20)
    size = (tmp_path / "m.gguf").stat().st_size
    kv = 2 * 2 * 1 * 16 * 2 * (bench.PROMPT_TOKENS + 64 // 2)
    assert bench.limit_tok_s(1e9, tmp_path / "m.gguf", 64) == pytest.approx(1e9 / (size + kv))


def test_binaries_found_below_a_given_folder_only(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import llama_cpp

    exe = tmp_path / "build" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / "build" / "bin" / "llama-quantize").write_text("not executable")
    assert llama_cpp.find_binary("llama-server", tmp_path / "build") == exe
    assert llama_cpp.find_binary("llama-server", tmp_path) == exe  # searched below the folder
    assert llama_cpp.find_binary("llama-quantize", tmp_path) is None


def test_table_has_ratios_and_the_single_stream_limit(bench):
    class Srv:
        def __init__(self, name, rss, ready):
            self.name, self.rss_ready, self.ready_s = name, rss, ready

    def row(c, tok_s, ttft, itl):
        return {"concurrency": c, "tok_s": tok_s, "ttft_p50": ttft, "itl_p50": itl, "rounds_tok_s": [tok_s, tok_s]}

    ours = [row(1, 20.0, 0.1, 0.05), row(8, 80.0, 0.4, 0.1)]
    peer = [row(1, 25.0, 0.05, 0.04), row(8, 100.0, 0.2, 0.08)]
    text = bench.table("m", [Srv("llmserve", 2 << 30, 3.0), Srv("llama-server", 1 << 30, 1.5)], [ours, peer], 40.0)
    lines = text.splitlines()
    assert "| 1 | llmserve | 20.0 | 40.0 (50%) | 100 | 50.0 | 2048 | 3.0 |" in lines
    assert "| 8 | llama-server | 100.0 |  | 200 | 80.0 | 1024 | 1.5 |" in lines
    ratio_1 = next(line for line in lines if line.startswith("| 1 | **ratio"))
    assert "rounds: 0.80 / 0.80" in ratio_1 and "**0.80x**" in ratio_1 and "| 2.00 | 1.25 | 2.00 | 2.00 |" in ratio_1


def test_rss_counts_a_live_process_and_not_a_gone_one(bench):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (64 << 20); time.sleep(30)"])
    try:
        deadline = time.time() + 20
        while bench.rss_bytes(child.pid) < 64 << 20 and time.time() < deadline:
            time.sleep(0.1)
        assert bench.rss_bytes(child.pid) >= 64 << 20
    finally:
        child.kill()
        child.wait()
    assert bench.rss_bytes(child.pid) == 0


def test_busy_processes_spin_while_the_block_runs_and_end_with_it(bench):
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    with bench.busy_processes(2):
        spinning = [p for p in me.children() if p.pid not in before]
        assert len(spinning) == 2 and all(p.is_running() for p in spinning)
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in spinning)
    with bench.busy_processes(0):
        assert {p.pid for p in me.children()} == before
