"""``llmserve bench serve`` end to end against the real embedded SmolLM2 server: the result table,
a JSON file whose token totals equal what the server counted (/metrics), a concurrency sweep,
both endpoints and a JSONL dataset; plain progress lines off a terminal; failures in one line.
Also the load generator's percentiles against numpy's."""

from __future__ import annotations

import json
import re
import sys
import time

import httpx
import pytest

from conftest import ECHO_PLUGIN, ROOT, free_port, run_cli


def counters(url: str) -> tuple[float, float]:
    """(prompt tokens, generated tokens) of every finished request so far."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"]


def settled_counters(url: str, expected_prompt: float) -> tuple[float, float]:
    """The counters once the engine has published the last step (they trail the stream's end)."""
    deadline = time.time() + 30
    while (now := counters(url))[0] < expected_prompt and time.time() < deadline:
        time.sleep(0.1)
    return now


def test_sweep_prints_the_table_and_writes_the_servers_token_counts(smollm_server, tmp_path):
    url = smollm_server.url
    before = counters(url)
    out = run_cli("bench", "serve", "--url", url, "--num-prompts", "3", "--max-concurrency", "1,2",
                  "--random-output-len", "4", "--ignore-eos", "--result-filename", str(tmp_path / "r.json"),
                  "--save-detailed", timeout=600)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    after = settled_counters(url, before[0] + doc["total_input_tokens"])
    # Every token the server generated and read for these requests, as its usage reported them.
    assert doc["total_output_tokens"] == after[1] - before[1] == 2 * 3 * 4
    assert doc["total_input_tokens"] == after[0] - before[0]
    assert doc["model_id"] == "SmolLM2-135M-Instruct" and doc["max_concurrency"] == [1, 2]
    for level, result in zip((1, 2), doc["results"]):
        assert result["max_concurrency"] == level
        assert result["completed"] == 3 and result["failed"] == 0 and result["usage_reported"] == 3
        assert result["output_lens"] == [4, 4, 4] and all(n > 0 for n in result["input_lens"])
        assert result["total_output_tokens"] == 12
        assert result["output_throughput"] == pytest.approx(12 / result["duration"])
        assert result["request_throughput"] == pytest.approx(3 / result["duration"])
        assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] <= max(result["ttfts"]) * 1000 + 1e-6
        # One gap between each pair of text events: at most 3 for 4 tokens (an event may carry
        # more than one token, e.g. when a token's text is held back until it is valid UTF-8).
        assert len(result["itls"]) == 3 and all(len(gaps) <= 3 for gaps in result["itls"])
        gaps = [g for request in result["itls"] for g in request]
        assert result["mean_itl_ms"] == pytest.approx(sum(gaps) / len(gaps) * 1000)
        assert result["mean_e2el_ms"] == pytest.approx(sum(result["e2els"]) / 3 * 1000)
    text = out.stdout
    assert text.count("Serving Benchmark Result") == 2
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):",
                  "Request throughput (req/s):", "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P90 TTFT (ms):", "P99 TTFT (ms):", "Mean ITL (ms):",
                  "P99 ITL (ms):", "Mean E2EL (ms):", "P99 E2EL (ms):"):
        assert label in text, label
    assert re.search(r"^Total generated tokens: +24$", text, re.M) is None  # per level, not summed
    assert len(re.findall(r"^Total generated tokens: +12$", text, re.M)) == 2
    rows = [line.split() for line in text.splitlines() if line.split()[:3] in (["1", "3", "0"], ["2", "3", "0"])]
    assert len(rows) == 2  # the sweep's summary table, one row per level
    # Not a terminal: progress comes as plain lines, never redrawn with a carriage return.
    assert "\r" not in out.stderr and "requests" in out.stderr


def test_chat_endpoint_with_a_jsonl_dataset(smollm_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join([
        json.dumps({"prompt": "Name a fruit.", "max_tokens": 2}),
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
        json.dumps("What is two plus two?"),
    ]) + "\n")
    url = smollm_server.url
    before = counters(url)
    out = run_cli("bench", "serve", "--url", url + "/v1", "--endpoint", "/v1/chat/completions", "--dataset-path",
                  str(data), "--num-prompts", "3", "--max-concurrency", "3", "--random-output-len", "3",
                  "--ignore-eos", "--save-result", "--result-dir", str(tmp_path / "out"), "--save-detailed",
                  "--disable-tqdm", timeout=600)
    assert out.returncode == 0, out.stderr
    [path] = (tmp_path / "out").glob("bench-serve-*.json")
    doc = json.loads(path.read_text())
    [result] = doc["results"]
    after = settled_counters(url, before[0] + result["total_input_tokens"])
    assert doc["dataset_name"] == "custom" and doc["endpoint"] == "/v1/chat/completions"
    assert sorted(result["output_lens"]) == [2, 3, 3]  # the first line's own max_tokens wins
    assert result["total_output_tokens"] == after[1] - before[1] == 8
    assert result["total_input_tokens"] == after[0] - before[0]
    assert out.stderr == ""  # --disable-tqdm: no progress


@pytest.fixture(scope="module")
def echo_server():
    from conftest import ServerProcess

    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--served-model-name", "echo",
                           "--api-key", "sesame")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_api_key_and_random_prompts(echo_server, tmp_path):
    out = run_cli("bench", "serve", "--url", echo_server.url, "--num-prompts", "2", "--max-concurrency", "1",
                  env={"LLMSERVE_API_KEY": "", "OPENAI_API_KEY": ""})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: the server at {echo_server.url}/v1/models refused the request (HTTP 401): "
        "pass its key with --api-key KEY (or set LLMSERVE_API_KEY)"]
    args = ["bench", "serve", "--url", echo_server.url, "--num-prompts", "4", "--max-concurrency", "2",
            "--random-input-len", "7", "--random-output-len", "5", "--seed", "3", "--result-filename"]
    runs = []
    for name in ("a.json", "b.json"):
        out = run_cli(*args, str(tmp_path / name), env={"LLMSERVE_API_KEY": "sesame"})
        assert out.returncode == 0, out.stderr
        runs.append(json.loads((tmp_path / name).read_text()))
    for doc in runs:
        [result] = doc["results"]
        assert doc["dataset_name"] == "random" and result["completed"] == 4
        # The echo backend's tokens are bytes: a prompt of 7 words is as many tokens as it has bytes.
        assert result["total_input_tokens"] > 4 * 7 and result["total_output_tokens"] == 4 * 5
    # The same seed gives the same prompts.
    assert runs[0]["results"][0]["total_input_tokens"] == runs[1]["results"][0]["total_input_tokens"]


def test_progress_is_a_bar_on_a_terminal(echo_server):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "llmserve", "bench", "serve", "--url", echo_server.url,
                                           "--num-prompts", "3", "--max-concurrency", "1", "--random-output-len", "3",
                                           "--api-key", "sesame"], cwd=str(ROOT), encoding="utf-8", timeout=120)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    # Redrawn in place; the last drawing is full, then the result block follows on a new line.
    assert re.search(r"\r\[#{30}\] concurrency 1: 3/3 requests, [0-9.]+ s\x1b\[K\r?\n", child.before)
    assert "Successful requests:" in child.before


def test_failed_requests_are_counted_and_named(echo_server):
    # Prompts of 4000 words, past the echo model's 512-token context: every request is refused with a
    # 400 (a max_tokens past the context is capped to fit, so it no longer fails a request).
    out = run_cli("bench", "serve", "--url", echo_server.url, "--num-prompts", "2", "--max-concurrency", "1",
                  "--random-input-len", "4000", "--random-output-len", "4", "--api-key", "sesame")
    assert out.returncode == 1
    assert re.search(r"^Failed requests: +2$", out.stdout, re.M)
    assert "error: HTTP 400" in out.stdout
    assert "every request failed at concurrency 1" in out.stderr


def test_unreachable_server_bad_dataset_and_missing_matplotlib(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = run_cli("bench", "serve", "--url", url, "--num-prompts", "1")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: cannot reach a server at {url}/v1 ([Errno 111] Connection refused); "
        "start one with `llmserve serve` or pass --url"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    out = run_cli("bench", "serve", "--url", url, "--dataset-path", str(bad))
    assert out.returncode == 1
    assert out.stderr.strip() == f'error: {bad}:2: needs "prompt" (a string) or "messages" (a list)'
    # matplotlib made unimportable in the child: --plot fails before any request, in one line.
    code = ("import sys; sys.modules['matplotlib'] = None; from llmserve.cli import main; "
            f"main(['bench', 'serve', '--url', '{url}', '--plot', 'x.png'])")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --plot needs matplotlib, which is not installed (pip install matplotlib)"


def test_plot_is_a_png(echo_server, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "latency.png"
    out = run_cli("bench", "serve", "--url", echo_server.url, "--num-prompts", "2", "--max-concurrency", "1,2",
                  "--random-output-len", "3", "--api-key", "sesame", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    from llmserve.plugins.commands.bench.loadgen import describe, percentile

    values = [0.3, 5.0, 1.25, 9.5, 2.0, 2.0, 7.75]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    stats = describe(values + [float("nan")])  # a request without text has no TTFT: left out
    assert stats["mean"] == pytest.approx(float(np.mean(values)))
    assert stats["p90"] == pytest.approx(float(np.percentile(values, 90)))
