"""The KServe/Triton statistics extension (``GET /v2/models/[{name}/]stats``), read from the
server's metrics: requests that finished normally count as successes, aborted and failed ones
as failures, and the engine's queue, prefill and decode times stand in for Triton's queue and
compute phases (there is no separate input/output tensor stage here)."""

from __future__ import annotations

from typing import Any


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(seconds * 1e9)}


def model_stats(name: str, version: str, metrics: Any) -> dict[str, Any]:
    """One entry of ``model_stats`` in the shape tritonclient's ``get_inference_statistics`` reads."""
    ok = metrics.success.get("stop", 0) + metrics.success.get("length", 0)
    failed = metrics.success.get("abort", 0) + metrics.success.get("error", 0)
    e2e = metrics.e2e
    mean = e2e.sum / e2e.count if e2e.count else 0.0
    last = metrics.last_finished
    return {
        "name": name, "version": version,
        "last_inference": int(last * 1000) if last else 0,
        "inference_count": ok, "execution_count": ok,
        "inference_stats": {
            "success": _duration(ok, mean * ok),
            "fail": _duration(failed, mean * failed),
            "queue": _duration(metrics.queue.count, metrics.queue.sum),
            "compute_input": _duration(metrics.prefill.count, 0.0),
            "compute_infer": _duration(metrics.prefill.count, metrics.prefill.sum + metrics.decode.sum),
            "compute_output": _duration(metrics.prefill.count, 0.0),
            "cache_hit": _duration(0, 0.0), "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [],
    }
