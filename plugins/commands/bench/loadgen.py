"""The closed-loop streaming load generator: N workers, each sending its next request as soon as
its last one finished, over one keep-alive connection per worker; per request the time to first
token, the gaps between text events (inter-token latency), the end-to-end latency and the token
counts of the server's ``usage``.

The client shares the machine's cores with the server under test, so it does as little as it can
per token: plain HTTP/1.1 over asyncio streams (chunked responses decoded by hand) instead of a
general HTTP client, and no JSON but for the event that carries usage; a pattern says whether an
event has text (a non-empty ``text``, ``content`` or ``reasoning_content`` value: completions and
chat chunks alike). Used by ``llmserve bench serve`` and by bench/serve_bench.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import resource
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

_HAS_TEXT = re.compile(rb'"(?:text|content|reasoning_content)":\s*"[^"]')
_HAS_USAGE = re.compile(rb'"usage":\s*\{')
_IS_ERROR = re.compile(rb'^data:\s*\{\s*"error"\s*:')


class RequestFailed(RuntimeError):
    """A request the server refused (its status and the start of its body) or broke off in-band."""


@dataclass
class Sample:
    """One request's measurements (times in seconds); ``error`` is set when it failed."""

    latency: float
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage: bool = False  # the token counts came from the server's usage (else: text events counted)
    error: str | None = None


@dataclass
class LevelRun:
    """Every request of one concurrency level, in the order they finished."""

    concurrency: int
    samples: list[Sample]
    wall_s: float
    client_cpu_s: float

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if s.error is not None]


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and yields the response body's lines.

    ``url`` is the server's base (``http://host:port`` or ``https://host/prefix``); every path
    is appended to its path. ``headers`` go with every request (e.g. ``Authorization``).
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        netloc = parts.netloc.rpartition("@")[2]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (f"Host: {netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{extra}")
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def _send(self, path: str, data: bytes) -> bytes:
        """Send the request; return the status line. A reused connection the server closed
        while idle (an empty status line: nothing was processed) is replaced once."""
        reused = self.writer is not None
        for _ in range(2):
            if self.writer is None:
                ctx = ssl.create_default_context() if self.tls else None
                self.reader, self.writer = await asyncio.open_connection(
                    self.host, self.port, limit=1 << 20, ssl=ctx, server_hostname=self.host if ctx else None)
            assert self.reader is not None
            self.writer.write(f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n\r\n"
                              .encode() + data)
            try:
                line = await self.reader.readline()
            except ConnectionResetError:
                line = b""
            if line or not reused:
                return line
            await self.close()
            reused = False
        return b""

    async def post_lines(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST ``body`` to ``path``; yield the response body line by line (bytes, without the
        newline). Raises ``RequestFailed`` on a status other than 200."""
        status_line = await self._send(path, json.dumps(body).encode())
        reader = self.reader
        assert reader is not None
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            await self.close()
            raise RequestFailed(f"no HTTP response ({status_line[:80]!r})") from None
        headers: dict[bytes, bytes] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.partition(b":")
            headers[key.strip().lower()] = value.strip().lower()
        closing = headers.get(b"connection") == b"close"  # the server ends it after this response
        if headers.get(b"transfer-encoding") == b"chunked":
            lines = self._chunked_lines()
            if status != 200:
                text = b"\n".join([line async for line in lines])
                raise RequestFailed(f"HTTP {status}: {text[:300].decode(errors='replace')}")
            async for line in lines:
                yield line
        else:
            size = int(headers.get(b"content-length", b"0"))
            text = await reader.readexactly(size) if size else b""
            if status != 200:
                if closing:
                    await self.close()
                raise RequestFailed(f"HTTP {status}: {text[:300].decode(errors='replace')}")
            for line in text.splitlines():
                yield line
        if closing:
            await self.close()

    async def _chunked_lines(self) -> AsyncIterator[bytes]:
        reader = self.reader
        assert reader is not None
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b""):  # trailers, then the end
                    pass
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line
        if pending:
            yield pending


async def one_request(conn: Connection, path: str, body: dict[str, Any]) -> Sample:
    """Send one streaming request and measure it; ``RequestFailed`` if the server refused it or
    sent an error event."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] | None = None
    async for line in conn.post_lines(path, body):
        if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
            continue
        if _HAS_TEXT.search(line):
            stamps.append(time.perf_counter())
        if _HAS_USAGE.search(line):
            usage = json.loads(line[5:]).get("usage") or usage
        elif _IS_ERROR.match(line):
            error = json.loads(line[5:])["error"]
            raise RequestFailed(f"error event: {error.get('message', error) if isinstance(error, dict) else error}")
    end = time.perf_counter()
    counted = usage is not None and usage.get("completion_tokens") is not None
    return Sample(latency=end - t0, ttft=(stamps[0] - t0) if stamps else math.nan,
                  itl=[b - a for a, b in zip(stamps, stamps[1:])],
                  output_tokens=usage["completion_tokens"] if usage and counted else len(stamps),
                  prompt_tokens=usage.get("prompt_tokens") if usage else None, usage=counted)


# What a failed request can raise: a refusal, a broken connection or stream, a timeout.
_FAILURES = (RequestFailed, OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError)


async def run_closed_loop(url: str, path: str, bodies: list[dict[str, Any]], concurrency: int, *,
                          headers: dict[str, str] | None = None, raise_errors: bool = True, timeout: float = 600.0,
                          on_sample: Callable[[Sample], None] | None = None) -> LevelRun:
    """Send every body in ``bodies`` to ``url + path`` from ``concurrency`` workers, each with
    its own keep-alive connection. A failed request raises (``raise_errors``) or is recorded
    as a sample with ``error`` set (its worker then opens a fresh connection)."""
    samples: list[Sample] = []
    queue = deque(bodies)

    async def worker() -> None:
        conn = Connection(url, headers)
        try:
            while queue:
                body = queue.popleft()
                t0 = time.perf_counter()
                try:
                    sample = await asyncio.wait_for(one_request(conn, path, body), timeout=timeout)
                except _FAILURES as exc:
                    if raise_errors:
                        raise
                    await conn.close()  # its state is unknown
                    message = f"timed out after {timeout:g} s" if isinstance(exc, asyncio.TimeoutError) else str(exc)
                    sample = Sample(latency=time.perf_counter() - t0, error=message or type(exc).__name__)
                samples.append(sample)
                if on_sample is not None:
                    on_sample(sample)
        finally:
            await conn.close()

    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return LevelRun(concurrency, samples, wall, (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime))


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks, as numpy's
    default; NaN values are left out; NaN when nothing is left."""
    data = sorted(v for v in values if v == v)
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def describe(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of ``values`` (NaN values left out)."""
    data = [v for v in values if v == v]
    return {"mean": sum(data) / len(data) if data else math.nan, "p50": percentile(data, 50),
            "p90": percentile(data, 90), "p99": percentile(data, 99)}
