"""The HTTP edge under hostile clients, against a real ``llmserve serve`` process.

Huge request heads (1 MiB and 100 MiB headers, 10,000 headers, a 100 KiB URL) are refused
before the API-key check with the server's memory flat; silent and trickling connections are
closed; a 64 MiB body gets a 413 that real clients (httpx, requests) actually read, and the
connection stays usable; one request writes one log line, with no query string or key in it.
Requests that no client library would send go out on raw sockets (``raw``).
"""

from __future__ import annotations

import json
import re
import select
import socket
import time

import httpx
import psutil
import pytest
import requests

from conftest import ECHO_PLUGIN, ServerProcess, serving

KEY = "edge-key-77a0"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
HEAD_TIMEOUT = 3.0
BODY_TIMEOUT = 3.0


def raw(port: int, method: str, target: str, headers: dict[str, str] | None = None, body: bytes | None = None,
        timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """Send one request exactly as given (``Connection: close``); (status, lower-cased headers, body).
    Status 0: the server closed without answering."""
    head = {"Host": f"127.0.0.1:{port}", "Connection": "close", **(headers or {})}
    if body is not None:
        head.setdefault("Content-Length", str(len(body)))
    lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall("\r\n".join(lines).encode("latin-1") + (body or b""))
        data = _read_all(sock)
    return _parse(data)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(status_line.split()[1]), headers, body


def _rss(server: ServerProcess) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


@pytest.fixture(scope="module")
def edge():
    with serving("--backend", "echo", "--plugin", ECHO_PLUGIN, "--api-key", KEY, "--log-level", "warning",
                 "--max-request-body-bytes", str(BODY_LIMIT), "--timeout-request-headers", str(HEAD_TIMEOUT),
                 "--timeout-request-body", str(BODY_TIMEOUT), "--timeout-keep-alive", "30", clean_log=True) as server:
        yield server


def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _flood(port: int, head: bytes, size: int, piece: int = 1 << 20) -> tuple[int, bytes, int]:
    """Send ``head`` then up to ``size`` bytes of header value in pieces, stopping once the server has
    answered; (status, answer, bytes of the value sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(head)
            while sent < size and not _answered(sock):
                sock.sendall(b"a" * piece)
                sent += piece
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _read_all(sock)
    return _parse(data)[0], data, sent


# -- request heads -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1 << 20, 100 << 20])
def test_huge_header_is_431_before_auth_with_flat_memory(edge, size):
    before = _rss(edge)
    started = time.monotonic()
    status, data, sent = _flood(edge.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ", size)
    elapsed = time.monotonic() - started
    assert status == 431, data[:300]
    assert b"--max-header-bytes" in data
    assert elapsed < 20, elapsed
    if size > 8 << 20:
        assert sent < size, sent  # answered long before the end of the header: it was never read whole
    assert _rss(edge) - before < 30 << 20, (before, _rss(edge))  # not read whole: not held whole
    assert httpx.get(edge.url + "/health").status_code == 200


def test_ten_thousand_headers_are_431(edge):
    before = _rss(edge)
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(10000))
    status, headers, body = _parse(_flood_once(edge.port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))
    assert status == 431 and b"--max-header-count" in body, body
    assert headers["connection"] == "close"
    assert _rss(edge) - before < 30 << 20
    # a request at the limits is served
    status, _, _ = raw(edge.port, "GET", "/health", {f"X-H{i}": "v" for i in range(200)})
    assert status == 200


def _flood_once(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return _read_all(sock)


def test_huge_url_is_414(edge):
    status, _, body = raw(edge.port, "GET", "/v1/models?" + "a" * 100_000)
    assert status == 414 and b"--max-header-bytes" in body
    status, _, _ = raw(edge.port, "GET", "/" + "a" * 200_000, AUTH)
    assert status == 414


@pytest.mark.parametrize("path,shape", [
    ("/v1/chat/completions", lambda b: set(b["error"]) == {"message", "type", "param", "code"}),
    ("/generate", lambda b: set(b) == {"error", "error_type"}),          # shared: its first dialect, TGI
    ("/api/chat", lambda b: set(b) == {"error"}),
    ("/v1/messages", lambda b: b["type"] == "error" and set(b["error"]) == {"type", "message"}),
    ("/no/such/route", lambda b: set(b["error"]) == {"message", "type", "param", "code"}),
])
def test_head_refusals_are_in_the_dialects_format(edge, path, shape):
    """A Content-Type with 10,000 parameters: 431 before the key check, in the error format of the
    dialect that owns the path, so that its clients parse it like any other error of the route."""
    content_type = "application/json" + "".join(f"; p{i}=v{i}" for i in range(10_000))
    status, headers, body = raw(edge.port, "POST", path, {"Content-Type": content_type}, body=b"{}")
    assert status == 431 and headers["content-type"] == "application/json", (headers, body[:200])
    parsed = json.loads(body)
    assert shape(parsed) and b"--max-header-bytes" in body, parsed
    status, headers, body = raw(edge.port, "GET", path + "?" + "a" * 100_000)
    assert status == 414 and shape(json.loads(body)), body[:200]


def test_header_limit_holds_for_a_key_too(edge):
    """The limits apply before the key is looked at: a valid key does not buy a bigger head."""
    status, _, _ = raw(edge.port, "GET", "/v1/models", {**AUTH, "X-Big": "b" * 70_000})
    assert status == 431
    status, _, _ = raw(edge.port, "GET", "/v1/models", {**AUTH, "X-Fine": "b" * 30_000})
    assert status == 200


# -- slow and silent clients ---------------------------------------------------------------------
def test_silent_connection_is_closed(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed without a word: it never began a request
        assert time.monotonic() - started < HEAD_TIMEOUT + 10


def test_trickled_head_is_408(edge):
    """A slow-loris client: one header byte at a time, each well inside any idle timeout."""
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(300):
                if _answered(sock):
                    break
                sock.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _read_all(sock)
    assert _parse(data)[0] == 408, data
    assert time.monotonic() - started < HEAD_TIMEOUT + 10


def test_trickled_head_on_a_kept_alive_connection_is_408(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(HEAD_TIMEOUT + 0.5)  # idle between requests is keep-alive time, not head time
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for _ in range(300):
                time.sleep(0.1)
                if _answered(sock):
                    break
                sock.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = _read_all(sock)
    assert _parse(data)[0] == 408, data


@pytest.mark.parametrize("path,check", [
    ("/v1/completions", lambda j: j["error"]["code"] == 408 and "--timeout-request-body" in j["error"]["message"]),
    ("/generate", lambda j: "--timeout-request-body" in j["error"]),  # TGI's format
])
@pytest.mark.parametrize("trickle", [True, False])
def test_trickled_or_stalled_body_is_408(edge, path, check, trickle):
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head + b'{"prompt": "')
        try:
            for _ in range(300):
                time.sleep(0.1)
                if _answered(sock):
                    break
                if trickle:
                    sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = _parse(_read_all(sock))
    assert status == 408, (status, body)
    assert check(json.loads(body)), body
    assert headers["connection"] == "close"
    assert BODY_TIMEOUT - 0.5 < time.monotonic() - started < BODY_TIMEOUT + 10
    assert httpx.get(edge.url + "/health").status_code == 200


def test_idle_kept_alive_connection_closes_after_keep_alive_timeout(server_process):
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--timeout-keep-alive", "1",
                            "--timeout-request-headers", "30", "--log-level", "warning")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert time.monotonic() - started < 10


# -- oversized bodies ----------------------------------------------------------------------------
BIG = 64 << 20


def test_64_mib_body_gets_a_413_the_client_reads(edge):
    body = b'{"prompt": "' + b"a" * BIG + b'"}'
    before = _rss(edge)
    for attempt in range(3):
        r = httpx.post(edge.url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == 413, (attempt, r.text)
        assert r.json()["error"]["code"] == 413 and str(BODY_LIMIT) in r.json()["error"]["message"]
        r = requests.post(edge.url + "/generate", data=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=60)
        assert r.status_code == 413 and r.json()["error_type"] == "validation", r.text  # TGI's format
    # streamed without Content-Length: refused once past the limit, the rest dropped
    r = httpx.post(edge.url + "/v1/chat/completions", content=iter([b"x" * (1 << 20)] * 64),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text
    # and without a key: the 401 is read as well
    r = httpx.post(edge.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 401
    assert _rss(edge) - before < 100 << 20  # the bodies were dropped, not kept


def test_connection_is_reused_after_a_413(edge):
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=60) as client:
        r = client.post("/v1/completions", content=b"x" * (8 << 20), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        r = client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hey"


def test_large_bodies_within_the_limit_are_not_taken_for_heads(edge):
    """Body bytes never count against the head limit, however the reads split them."""
    prompt = {"prompt": "a" * (BODY_LIMIT - 1000), "max_tokens": 1}
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=60) as client:
        for _ in range(3):
            r = client.post("/v1/completions", json=prompt)
            assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
            data = httpx.Request("POST", "/", json=prompt).read()
            pieces = [data[i:i + 100_000] for i in range(0, len(data), 100_000)]
            r = client.post("/v1/completions", content=iter(pieces), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
        assert client.get("/v1/models").status_code == 200


# -- the log -------------------------------------------------------------------------------------
def _log_lines(log: str, rid: str) -> list[str]:
    return [line for line in log.splitlines() if rid in line]


def test_one_log_line_per_request_and_no_key_in_it():
    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--api-key", KEY, "--log-level", "info")
    try:
        server.wait_ready()
        r = httpx.get(server.url + f"/v1/models?api_key={KEY}&x=1", headers={"X-Request-Id": "log-probe-1"})
        assert r.status_code == 401
        r = httpx.get(server.url + "/v1/models?api_key=other-secret", headers={**AUTH, "X-Request-Id": "log-probe-2"})
        assert r.status_code == 200
    finally:
        log = server.stop()
    for rid in ("log-probe-1", "log-probe-2"):
        lines = _log_lines(log, rid)
        assert len(lines) == 1 and "llmserve.access" in lines[0], lines
    assert not re.search(r'"(GET|POST) /v1/models', log.replace('route="GET /v1/models"', ""))  # no uvicorn line
    assert KEY not in log and "other-secret" not in log and "api_key" not in log


def test_uvicorn_access_log_on_request_has_no_query_string():
    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "info",
                           "--no-disable-uvicorn-access-log")
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/v1/models?api_key=qs-secret-9").status_code == 200
    finally:
        log = server.stop()
    assert re.search(r'"GET /v1/models HTTP/1.1" 200', log), log
    assert "qs-secret-9" not in log


def test_uvicorn_log_level_is_its_own():
    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "info",
                           "--uvicorn-log-level", "warning")
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        log = server.stop()
    assert "llmserve.server" in log and "Application startup complete" not in log, log
