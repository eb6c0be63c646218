"""Operations: /metrics (parsed as Prometheus does), /ready, the request log line.

Metrics are checked on the real SmolLM2 server (the engine's own counters are the point);
the log test runs its own echo server so that it can read the whole log afterwards.
"""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import ECHO_PLUGIN

parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, sorted labels): value}}}."""
    r = httpx.get(url + "/metrics", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in parser.text_string_to_metric_families(r.text):
        out[family.name] = {"type": family.type,
                            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}}
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels: str) -> float:
    samples = metrics[family]["samples"]
    hits = [v for (name, lab), v in samples.items()
            if name == (sample or family) and all(dict(lab).get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (family, sample, labels, samples)
    return hits[0]


def test_metrics_move_with_requests(smollm_server):
    url = smollm_server.url
    before = scrape(url)
    names = {dict(lab).get("model_name") for fam in before.values() for (_, lab) in fam["samples"]}
    assert len(names - {None}) == 1  # every series carries the model_name label
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                       "ignore_eos": True, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                      timeout=120) as r:
        assert r.status_code == 200
        r.read()
    after = scrape(url)

    # parsed types follow the vLLM names (prometheus_client strips _total from counter families)
    assert after["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert after["vllm:e2e_request_latency_seconds"]["type"] == "histogram"
    assert after["vllm:inter_token_latency_seconds"]["type"] == "histogram"
    assert after["vllm:time_per_output_token_seconds"]["type"] == "histogram"
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):
        assert after[gauge]["type"] == "gauge"
    for counter in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:prefix_cache_queries",
                    "vllm:prefix_cache_hits", "vllm:num_preemptions", "llmserve:admission_rejections"):
        assert after[counter]["type"] == "counter", counter
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0

    def delta(family, sample=None, **labels):
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 3
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") >= 4 + 4 + 3
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") >= 3
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
    for hist, at_least in (("vllm:time_to_first_token_seconds", 3), ("vllm:e2e_request_latency_seconds", 3),
                           ("vllm:inter_token_latency_seconds", 3 + 3 + 2), ("vllm:request_prompt_tokens", 3),
                           ("vllm:request_generation_tokens", 3)):
        assert delta(hist, hist + "_count") >= at_least, hist
        assert value(after, hist, hist + "_bucket", le="+Inf") == value(after, hist, hist + "_count")
        assert delta(hist, hist + "_sum") > 0, hist
        buckets = sorted(((float(dict(lab)["le"]), v) for (name, lab), v in after[hist]["samples"].items()
                          if name == hist + "_bucket"))
        assert len(buckets) > 5 and all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))  # cumulative
    # every finish reason has its series from the start, so rate() works before the first error
    assert {"stop", "length", "abort", "error"} <= {dict(lab)["finished_reason"] for (name, lab) in
                                                    after["vllm:request_success"]["samples"]}


def test_ready_and_health(smollm_server):
    r = httpx.get(smollm_server.url + "/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    assert httpx.get(smollm_server.url + "/health").status_code == 200


def test_readiness_states():
    from llmserve.config import ServerConfig
    from llmserve.server.context import ServerContext

    class Engine:
        is_dead = False

    ctx = ServerContext(config=ServerConfig())
    assert ctx.readiness() == "loading"
    ctx.model, ctx.engine, ctx.ready = object(), Engine(), True
    assert ctx.readiness() is None
    ctx.engine.is_dead = True
    assert ctx.readiness() == "engine dead"
    ctx.engine.is_dead = False
    ctx.draining = True
    assert ctx.readiness() == "draining"


def test_ready_route_follows_the_context_flags(echo_app):
    client, ctx = echo_app()
    assert client.get("/ready").status_code == 200
    ctx.draining = True  # what SIGTERM handling sets
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    assert client.get("/health").status_code == 200  # liveness is not readiness
    ctx.draining = False
    ctx.ready = False
    assert client.get("/ready").status_code == 503


def test_admission_rejections_are_counted(echo_app):
    client, ctx = echo_app()
    ctx.metrics.rejected("queue_full")
    ctx.metrics.rejected("queue_full")
    ctx.metrics.rejected("draining")
    metrics = {}
    for family in parser.text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "llmserve:admission_rejections":
            metrics = {s.labels["reason"]: s.value for s in family.samples}
    assert metrics == {"queue_full": 2.0, "draining": 1.0}


def test_public_metrics_flag(echo_app):
    client, _ = echo_app(api_key=["k"])
    assert client.get("/metrics").status_code == 401
    client, _ = echo_app(api_key=["k"], public_metrics=True)
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 401  # only /metrics became public


def test_request_log_has_counts_and_no_secrets(server_process):
    key, secret = "sk-log-test-key-5521", "PURPLE-ELEPHANT-SECRET-7731"
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--api-key", key, "--log-level", "info")
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": "req-abc-123"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": secret, "max_tokens": 5}, headers=headers,
                   timeout=30)
    assert r.status_code == 200 and secret[:5] in r.json()["choices"][0]["text"]  # echo returns the prompt
    r = httpx.post(server.url + "/generate", json={"inputs": secret, "parameters": {"max_new_tokens": 4}},
                   headers={"X-Api-Key": key}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": secret},
                   headers={"Authorization": "Bearer " + secret})
    assert r.status_code == 401
    log = server.stop()
    assert secret not in log and secret[:12] not in log
    assert key not in log
    lines = [line for line in log.splitlines() if "llmserve.access" in line]
    first = next(line for line in lines if "request_id=req-abc-123" in line)
    assert 'dialect=openai route="POST /v1/completions" status=200' in first
    assert f"prompt_tokens={len(secret)} completion_tokens=5" in first
    assert re.search(r"ttft=\d+\.\d+s total=\d+\.\d+s", first)
    tgi = next(line for line in lines if 'route="POST /generate"' in line and "status=200" in line)
    assert "dialect=tgi" in tgi and "completion_tokens=4" in tgi
    assert any("status=401" in line for line in lines)
