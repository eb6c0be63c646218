"""``/metrics`` carries the vLLM families that vLLM's dashboards and the Gateway API Inference
Extension read, with vLLM's names, types and labels, and their values move as requests run.
Parsed with Prometheus's own parser; on the echo backend (one token per byte, so every count
is known in advance)."""

from __future__ import annotations

import threading
import time

import pytest

parser = pytest.importorskip("prometheus_client.parser")

HISTOGRAMS = ("vllm:iteration_tokens_total", "vllm:request_params_n", "vllm:request_params_max_tokens",
              "vllm:request_inference_time_seconds", "vllm:request_num_preemptions")
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:num_requests_waiting_by_reason", "vllm:cache_config_info")


def scrape(client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in parser.text_string_to_metric_families(r.text)}


def sample(families: dict, family: str, name: str | None = None, **labels: str) -> float:
    hits = [s.value for s in families[family].samples
            if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, name, labels, families[family].samples)
    return hits[0]


def hist(families: dict, family: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return sample(families, family, family + "_count"), sample(families, family, family + "_sum")


@pytest.fixture
def echo(echo_app, monkeypatch):
    monkeypatch.setenv("LLMSERVE_ECHO_STEP_DELAY", "0.02")  # requests stay long enough to be seen waiting
    client, context = echo_app(max_num_seqs=1, served_model_name=["echo"])
    return client, context


def test_families_names_types_and_labels(echo):
    client, context = echo
    m = scrape(client)
    for name in HISTOGRAMS:
        assert m[name].type == "histogram", name
        assert {s.labels["model_name"] for s in m[name].samples} == {"echo"}
    for name in GAUGES:
        assert m[name].type == "gauge", name
    assert {s.labels["reason"] for s in m["vllm:num_requests_waiting_by_reason"].samples} == {"capacity", "deferred"}
    assert all(s.labels["model_name"] == "echo" for s in m["vllm:num_requests_waiting_by_reason"].samples)
    [info] = m["vllm:cache_config_info"].samples
    assert info.value == 1.0 and "model_name" not in info.labels  # as vLLM's: the labels are the config
    stats = context.engine.stats()
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == str(stats.kv_blocks_total)
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["cache_dtype"] == "auto"
    assert info.labels["engine"] == "0"
    assert [b.labels["le"] for b in m["vllm:request_params_n"].samples if b.name.endswith("_bucket")] == [
        "1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert [b.labels["le"] for b in m["vllm:request_num_preemptions"].samples if b.name.endswith("_bucket")] == [
        "1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf"]


def test_request_histograms_move_with_requests(echo):
    client, _ = echo
    before = scrape(client)
    # vllm:iteration_tokens_total counts as vLLM does: each sequence's p prompt tokens once, with
    # its first token, and its g generated tokens (p + g per sequence, however it was scheduled).
    r = client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 3, "n": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                  "disable_chat_template": True, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    after = scrape(client)

    def moved(family: str) -> tuple[float, float]:
        (c0, s0), (c1, s1) = hist(before, family), hist(after, family)
        return c1 - c0, s1 - s0

    assert moved("vllm:request_params_n") == (2, 3)              # n=2, then n=1
    assert moved("vllm:request_params_max_tokens") == (2, 7)
    count, tokens = moved("vllm:iteration_tokens_total")
    assert tokens == 2 * (6 + 3) + (5 + 4) and count >= 3 + 4
    assert moved("vllm:request_num_preemptions") == (2, 0)
    count, seconds = moved("vllm:request_inference_time_seconds")
    assert count == 2 and seconds >= (3 + 4) * 0.02  # every step sleeps 20 ms
    assert sample(after, "vllm:request_params_n", "vllm:request_params_n_bucket", le="1.0") == \
        sample(before, "vllm:request_params_n", "vllm:request_params_n_bucket", le="1.0") + 1


def test_waiting_by_reason_tracks_the_queue(echo):
    client, _ = echo
    done: list[int] = []

    def run(i: int) -> None:
        r = client.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": 40, "ignore_eos": True})
        done.append(r.status_code)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while True:  # one runs (--max-num-seqs 1), the other two wait for capacity
        m = scrape(client)
        if sample(m, "vllm:num_requests_waiting") == 2:
            break
        assert time.time() < deadline, "the queue never filled"
        time.sleep(0.01)
    assert sample(m, "vllm:num_requests_running") == 1
    assert sample(m, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert sample(m, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert 0 < sample(m, "vllm:kv_cache_usage_perc") <= 1
    for t in threads:
        t.join(60)
    assert done == [200, 200, 200]
    # The last answer can reach its client before the engine loop publishes the step's gauges:
    # wait for them to settle rather than race that publication.
    deadline = time.time() + 30
    while True:
        m = scrape(client)
        if sample(m, "vllm:num_requests_running") == 0:
            break
        assert time.time() < deadline, "a finished request stayed counted as running"
        time.sleep(0.01)
    assert sample(m, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert sample(m, "vllm:num_requests_waiting") == 0


def test_iteration_tokens_do_not_depend_on_the_prefix_cache(echo):
    """The same request twice: the second finds its prompt's full blocks in the prefix cache and
    computes only the rest, yet both count the same tokens (vLLM's count: prompt plus output)."""
    client, _ = echo
    body = {"prompt": "a prompt of forty bytes, two full blocks", "max_tokens": 5}
    moved = []
    for _ in range(2):
        before = hist(scrape(client), "vllm:iteration_tokens_total")[1]
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        moved.append(hist(scrape(client), "vllm:iteration_tokens_total")[1] - before)
    m = scrape(client)  # the parser names a counter's family without its _total
    queried, hit = (sample(m, f"vllm:prefix_cache_{k}", f"vllm:prefix_cache_{k}_total") for k in ("queries", "hits"))
    assert hit >= 32 and queried >= hit  # the second request did reuse the first one's blocks
    assert moved == [40 + 5, 40 + 5]


def test_admission_rejections_under_the_vllm_prefix(echo):
    client, context = echo
    context.metrics.rejected("waiting")
    m = scrape(client)
    for name in ("vllm:admission_rejections", "llmserve:admission_rejections"):  # the first name is kept
        assert sample(m, name, name + "_total", reason="waiting") == 1
