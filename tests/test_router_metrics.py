"""The gauges a load-aware router schedules by, read as Prometheus reads them, under load.

Gateways that pick a replica per request (the Gateway API Inference Extension's endpoint
picker, llm-d's scheduler) scrape each replica's /metrics for its queue depth, running batch
and KV-cache use under vLLM's names. This test runs a server on the echo backend with a slow
step and a batch of two, sends six long requests at once, and watches the three gauges move
from idle to load and back, while the liveness and readiness probes keep answering 200.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import ECHO_PLUGIN

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def gauges(url: str) -> dict[str, float]:
    """The three router gauges from one scrape, checked to be gauges with one series each."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    out = {}
    for family in parser.text_string_to_metric_families(r.text):
        if family.name in GAUGES:
            assert family.type == "gauge", (family.name, family.type)
            assert len(family.samples) == 1, family.samples
            assert family.samples[0].labels.get("model_name") == "echo"
            out[family.name] = family.samples[0].value
    assert set(out) == set(GAUGES), out
    return out


def test_router_gauges_follow_the_load(server_process):
    server = server_process("--plugin", ECHO_PLUGIN, "--backend", "echo", "--max-num-seqs", "2",
                            "--log-level", "warning", env={"LLMSERVE_ECHO_STEP_DELAY": "0.03"})
    url = server.url
    assert gauges(url) == dict.fromkeys(GAUGES, 0.0)

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    results: list[int] = []

    def one() -> None:
        out = client.completions.create(model="echo", prompt="route me by my load", max_tokens=40,
                                        extra_body={"ignore_eos": True})
        results.append(out.usage.completion_tokens)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for thread in threads:
        thread.start()
    seen: dict[str, list[float]] = {name: [] for name in GAUGES}
    probes: set[int] = set()
    while any(thread.is_alive() for thread in threads):
        for name, value in gauges(url).items():
            seen[name].append(value)
        probes |= {httpx.get(url + path, timeout=10).status_code for path in ("/health", "/ready")}
        time.sleep(0.02)
    for thread in threads:
        thread.join()

    assert results == [40] * 6
    # A batch of two: at most two run, the other four wait their turn, and the running ones hold KV blocks.
    assert max(seen["vllm:num_requests_running"]) == 2, seen["vllm:num_requests_running"]
    assert max(seen["vllm:num_requests_waiting"]) >= 1, seen["vllm:num_requests_waiting"]
    assert 0 < max(seen["vllm:kv_cache_usage_perc"]) <= 1, seen["vllm:kv_cache_usage_perc"]
    assert probes == {200}  # probes stay green under load: load shows on /metrics, not on health
    # Back to idle: nothing queued or running, every block free again.
    deadline = time.time() + 10
    while gauges(url) != dict.fromkeys(GAUGES, 0.0) and time.time() < deadline:
        time.sleep(0.05)
    assert gauges(url) == dict.fromkeys(GAUGES, 0.0)
