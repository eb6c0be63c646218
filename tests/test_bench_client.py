"""The serving benchmark's own HTTP client (bench/serve_bench.py): it decodes chunked SSE
responses by hand, so check it against a real server: token counts from usage, one TTFT per
request, keep-alive reuse across requests, and a clear error on a refused request."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from conftest import ECHO_PLUGIN, ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
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
