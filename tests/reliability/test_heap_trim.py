"""Memory grown by large requests goes back to the system once the server is idle
(``--heap-trim-interval``), and stays grown with the trimmer off."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from conftest import ECHO_PLUGIN, ServerProcess


def _rss(server: ServerProcess) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def _grown_then_idle(interval: str) -> tuple[int, int, int]:
    """RSS at start, after a burst of large bodies, and after idling past the trim interval."""
    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning",
                           "--heap-trim-interval", interval, "--trust-request-chat-template")
    server.wait_ready()
    try:
        start = _rss(server)
        # Many mid-sized strings (heap allocations, not mmaps) in one body: parsed, validated,
        # then refused, and freed, leaving holes in the heap.
        body = {"model": "echo", "max_tokens": 1,
                "messages": [{"role": "user", "content": f"{i:06d}" + "x" * 1500} for i in range(12000)]}
        # Sent at once, so that the server is never idle (and never trims) during the burst.
        with httpx.Client(base_url=server.url, timeout=120) as client, ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda _: client.post("/v1/chat/completions", json=body), range(3)))
        grown = _rss(server)
        time.sleep(5.0)  # two trim intervals and some
        return start, grown, _rss(server)
    finally:
        server.stop()


@pytest.mark.skipif(not psutil.LINUX, reason="malloc_trim is glibc's")
def test_rss_returns_after_a_burst_of_large_requests():
    start_off, grown_off, idle_off = _grown_then_idle("0")
    start_on, grown_on, idle_on = _grown_then_idle("2")
    mib = 1 << 20
    figures = (f"off: {start_off // mib} -> {grown_off // mib} -> {idle_off // mib} MiB; "
               f"on: {start_on // mib} -> {grown_on // mib} -> {idle_on // mib} MiB")
    assert grown_on - start_on > 40 * mib, "the burst did not grow the heap: " + figures
    # With the trimmer, at least three quarters of the growth is given back; without it, glibc
    # returns only the free top of its heap, and the holes below stay counted.
    assert idle_on - start_on < (grown_on - start_on) / 4, figures
    assert idle_off - start_off > idle_on - start_on, figures
