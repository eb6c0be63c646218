"""`llmserve ray-serve`'s pieces that need no Ray: replica options and the replica header.

The end-to-end run on Ray is tests/scale_out/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from llmserve.config import ServerConfig
from llmserve.plugins.commands.ray_serve import (REPLICA_HEADER, LLMServeReplica, RayOptions, deployment_options,
                                                 with_replica_header)


def test_fixed_replicas():
    out = deployment_options(ServerConfig(max_num_seqs=8, shutdown_timeout=12), RayOptions(replicas=3,
                                                                                           replica_cpus=2))
    assert out["num_replicas"] == 3 and "autoscaling_config" not in out
    assert out["max_ongoing_requests"] == 8  # one engine batch per replica; Ray queues the rest
    assert out["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.0}
    assert out["graceful_shutdown_timeout_s"] == 12.0


def test_autoscaling():
    out = deployment_options(ServerConfig(max_num_seqs=16), RayOptions(replicas=2, min_replicas=1, max_replicas=4))
    assert "num_replicas" not in out
    assert out["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                         "target_ongoing_requests": 8.0}
    out = deployment_options(ServerConfig(), RayOptions(max_replicas=2, target_ongoing_requests=3,
                                                        max_ongoing_requests=6))
    assert out["autoscaling_config"]["target_ongoing_requests"] == 3
    assert out["autoscaling_config"]["min_replicas"] == 1 and out["max_ongoing_requests"] == 6


@pytest.mark.parametrize("options, message", [
    (RayOptions(min_replicas=1), "need --max-replicas"),
    (RayOptions(target_ongoing_requests=2), "need --max-replicas"),
    (RayOptions(min_replicas=5, max_replicas=2), "between 0 and --max-replicas"),
])
def test_inconsistent_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        deployment_options(ServerConfig(), options)


def test_every_response_names_its_replica():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"x-request-id", b"abc")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(with_replica_header(app, "r1")({"type": "http"}, receive, send))
    headers = sent[0]["headers"]
    assert (REPLICA_HEADER.encode(), b"r1") in headers
    assert (b"content-type", b"text/plain") in headers
    assert all(k != b"x-request-id" for k, _ in headers)  # Ray's proxy adds its own
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}


def test_health_check_fails_once_the_engine_died(echo_app, monkeypatch):
    """What Ray calls every --health-check-period: fine while the engine runs, an error (so Ray
    replaces the replica) once the engine loop has died."""
    monkeypatch.setenv("LLMSERVE_FAULT_INJECTION", "step:1")  # the first model step kills the engine
    client, context = echo_app()
    replica = LLMServeReplica.__new__(LLMServeReplica)  # the replica's state without a Ray actor
    replica.context = context
    replica.check_health()
    r = client.post("/v1/completions", json={"model": "echo", "prompt": "hi", "max_tokens": 2})
    assert r.status_code >= 500
    deadline = time.time() + 10
    while not context.engine.is_dead and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(RuntimeError, match="engine of this replica died"):
        replica.check_health()
