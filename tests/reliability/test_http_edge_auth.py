"""Keys on every route, read from the served app's route table: nothing answers without a key
but the probes, whatever the method, the Host header or the spelling of the path.

One server (uvicorn, loopback, in this process so that the test reads the app it serves) with
every registered dialect enabled, a third-party dialect loaded from a plugin file (a plain
``APIRouter``, so it gets no help from the dialect kit), and an API key. The requests go out
on raw sockets: clients normalise paths and refuse odd Host headers, attackers do not.
"""

from __future__ import annotations

import re
import socket
import textwrap
import pytest

from .conftest import InProcServer
from .test_http_edge import raw

KEY = "edge-key-5d1e"
PROBES = {"/health", "/ping", "/ready"}  # open without a key: liveness and readiness
PAGES = {"/playground", "/docs", "/redoc", "/assets/{name}"}  # and the browser pages' static files (GET)
OUTSIDE_PLUGIN = '''
"""A third-party dialect: plain FastAPI routes, several methods, a path parameter."""
from fastapi import APIRouter, WebSocket

from llmserve import hookimpl
from llmserve.hooks.records import ProtocolSpec
from llmserve.server.protocol import Protocol


class Outside(Protocol):
    def router(self):
        router = APIRouter()

        @router.get("/outside/items/{item_id}")
        async def item(item_id: str):
            return {"item": item_id}

        @router.api_route("/outside/run", methods=["POST", "PUT", "PATCH", "DELETE"])
        async def run():
            return {"ran": True}

        @router.get("/health/outside")  # looks like a probe, is not one
        async def not_a_probe():
            return {"probe": False}

        @router.websocket("/outside/ws")
        async def socket(websocket: WebSocket):
            await websocket.accept()
            await websocket.send_text("hello")
            await websocket.close()

        return router


@hookimpl
def register_protocols():
    return [ProtocolSpec(name="outside", target=f"{__name__}:Outside")]
'''


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from llmserve.hooks.manager import PluginManager
    from llmserve.hooks.registry import Registry

    plugin = tmp_path_factory.mktemp("outside") / "outside_dialect.py"
    plugin.write_text(textwrap.dedent(OUTSIDE_PLUGIN))
    manager = PluginManager().load(autoload=False)
    manager.load_spec(str(plugin), "test")
    every = Registry.collect(manager).names("protocol")  # every dialect there is, not just the defaults
    assert "outside" in every and "openai" in every
    from conftest import ECHO_PLUGIN

    server = InProcServer(backend="echo", plugins=[ECHO_PLUGIN, str(plugin)], protocols=every, api_key=[KEY],
                          trust_request_chat_template=True, enable_request_id_headers=True)
    yield server
    server.stop()


def _concrete(path: str) -> str:
    """A request path for a route template: each parameter gets a plain value."""
    return re.sub(r"\{[^}:]+(:[^}]+)?\}", lambda m: "1" if m.group(1) == ":int" else "x", path)


def _routes(server: InProcServer) -> list[tuple[str, list[str]]]:
    """(template, methods) of every route the served app mounts, read from the app itself
    (FastAPI's route contexts resolve included routers and their prefixes)."""
    from fastapi.routing import iter_route_contexts

    found: list[tuple[str, list[str]]] = []
    for route in iter_route_contexts(server.server.config.app.routes):
        if route.path is None:
            continue
        methods = route.methods
        if methods is None and hasattr(route.route, "routes"):  # a Mount: probe below it
            found.append((route.path + "/x", ["GET", "POST"]))
        else:
            found.append((route.path, sorted(methods or {"GET"})))
    return found


def _status(response: tuple[int, dict[str, str], bytes]) -> int:
    return response[0]


def test_every_mounted_route_needs_a_key_in_every_method(keyed):
    routes = _routes(keyed)
    paths = {p for p, _ in routes}
    # The table is the app's own: the third-party dialect, the probes and /openapi.json are in it.
    assert {"/outside/run", "/outside/items/{item_id}", "/openapi.json", "/health", "/metrics"} <= paths
    assert len(routes) > 30, routes
    by_path: dict[str, set[str]] = {}
    for template, methods in routes:  # one path may be several routes (GET /ping and POST /ping)
        by_path.setdefault(template, set()).update(methods)
    served: list[tuple[str, str, int]] = []
    for template, methods in sorted(by_path.items()):
        path = _concrete(template)
        for method in sorted({*methods, "HEAD", "OPTIONS"}):
            status, headers, _ = raw(keyed.port, method, path, body=b"{}" if method in ("POST", "PUT", "PATCH")
                                     else None)
            public = template in PROBES and (method in methods or (method == "HEAD" and "GET" in methods))
            if template in PAGES and method in ("GET", "HEAD"):
                assert status != 401, (method, path, status)
            elif public:
                assert status == 200, (method, path, status)
            else:
                assert status == 401, (method, path, status)
                assert headers.get("www-authenticate") == "Bearer", (method, path)
            assert re.fullmatch(r"[0-9a-f]{32}", headers.get("x-request-id", "")), (method, path, headers)
            if method in methods:
                keyed_status = _status(raw(keyed.port, method, path, {"Authorization": f"Bearer {KEY}"},
                                           body=b"{}" if method in ("POST", "PUT", "PATCH") else None))
                served.append((method, path, keyed_status))
    # With the key the same requests reach their routes: whatever they answer, it is not a 401.
    assert all(status != 401 for _, _, status in served), [s for s in served if s[2] == 401]
    assert ("POST", "/outside/run", 200) in served and ("GET", "/outside/items/x", 200) in served


HOSTS = ["a/v1?", "x/", "a#", "localhost/health?", "h/v1/models#", "evil.example/..", ""]


def test_host_header_tricks_change_nothing(keyed):
    for template, methods in _routes(keyed):
        if template in PROBES | PAGES:
            continue
        path, method = _concrete(template), sorted(methods)[0]
        for host in HOSTS:
            status, _, _ = raw(keyed.port, method, path, {"Host": host} if host else {"Host": ""})
            assert status in (401, 400), (host, method, path, status)  # 400: uvicorn refused the request
    # A probe stays a probe under any Host, and a route with the key is served under any Host.
    for host in HOSTS[:4]:
        assert _status(raw(keyed.port, "GET", "/health", {"Host": host})) == 200, host
        assert _status(raw(keyed.port, "GET", "/v1/models", {"Host": host,
                                                              "Authorization": f"Bearer {KEY}"})) == 200, host


WS = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
      "Sec-WebSocket-Version": "13"}


def _upgrade(port: int, path: str, headers: dict[str, str]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = {"Host": "x", **WS, **headers}
        sock.sendall(f"GET {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode()
                     + b"\r\n")
        return sock.recv(4096)


def test_websocket_upgrades_need_a_key_too(keyed):
    for template, _ in _routes(keyed):
        answer = _upgrade(keyed.port, _concrete(template), {})
        assert answer.startswith(b"HTTP/1.1 403"), (template, answer[:100])
    answer = _upgrade(keyed.port, "/outside/ws", {"Authorization": f"Bearer {KEY}"})
    assert answer.startswith(b"HTTP/1.1 101"), answer[:100]  # the key opens it
    assert _upgrade(keyed.port, "/outside/ws", {"Authorization": "Bearer wrong"}).startswith(b"HTTP/1.1 403")


@pytest.mark.parametrize("target", [
    "//v1/models", "/v1/../v1/models", "/v1/./models", "/v1%2Fmodels", "/v1%2fmodels", "/V1/models",
    "/v1/MODELS", "/v1/models.", "/v1/models/", "/v1/models%00", "/v1/models;x", "/%76%31/models",
    "/health/../v1/models", "/health/%2e%2e/v1/models", "/health%2F..%2Fv1/models", "/health/.", "/health.",
    "/HEALTH", "/health/", "//health", "/ready/../metrics", "/./metrics", "/metrics/", "/openapi.json/",
    "http://127.0.0.1/v1/models", "*",
])
def test_path_tricks_are_never_served_without_a_key(keyed, target):
    for method in ("GET", "POST", "HEAD", "OPTIONS"):
        status, _, body = raw(keyed.port, method, target, body=b"{}" if method == "POST" else None)
        assert status in (400, 401), (method, target, status, body[:200])  # 400: not an HTTP request target
        assert b'"data"' not in body and b"llmserve_" not in body


def test_head_answers_like_get(keyed):
    get, head = raw(keyed.port, "GET", "/health"), raw(keyed.port, "HEAD", "/health")
    assert get[0] == head[0] == 200
    assert head[2] == b""
    assert head[1].get("content-length") == get[1].get("content-length")
    ready = raw(keyed.port, "HEAD", "/ready")
    assert ready[0] == 200 and ready[2] == b"" and ready[1]["content-type"] == "application/json"
    # a keyed GET route answers HEAD with the key, without a body
    models = raw(keyed.port, "HEAD", "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert models[0] == 200 and models[2] == b"" and int(models[1]["content-length"]) > 0
    assert raw(keyed.port, "HEAD", "/v1/models")[0] == 401


def test_preflight_without_cors_needs_a_key(keyed):
    """CORS is off: a browser preflight is an OPTIONS like any other and reaches no route."""
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    for path in ("/v1/chat/completions", "/health", "/generate"):
        status, headers, _ = raw(keyed.port, "OPTIONS", path, pre)
        assert status == 401, (path, status)
        assert not any(h.startswith("access-control-") for h in headers)


def test_metrics_open_only_by_flag():
    from conftest import ECHO_PLUGIN

    server = InProcServer(backend="echo", plugins=[ECHO_PLUGIN], api_key=[KEY], public_metrics=True)
    try:
        status, _, body = raw(server.port, "GET", "/metrics")
        assert status == 200 and b"# TYPE" in body
        assert raw(server.port, "HEAD", "/metrics")[0] == 200
        assert raw(server.port, "POST", "/metrics", body=b"{}")[0] == 401  # only the GET is the scrape
        assert raw(server.port, "GET", "/v1/models")[0] == 401
    finally:
        server.stop()


@pytest.mark.parametrize("given,echoed", [
    ("req-42", "req-42"),
    ("a/b+c=d@e:f_g.h~i", "a/b+c=d@e:f_g.h~i"),
    ("x" * 128, "x" * 128),
    ("x" * 129, None),
    ("x" * 5000, None),
    ("two words", None),
    ('quote"d', None),
    ("caf\xe9", None),
    ("tab\there", None),
])
def test_request_id_is_sanitised_and_echoed_on_every_reply(keyed, given, echoed):
    for method, path, headers in (("GET", "/health", {}), ("GET", "/v1/models", {}),
                                  ("GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}),
                                  ("POST", "/generate", {"Authorization": f"Bearer {KEY}"}),
                                  ("GET", "/no/such/route", {"Authorization": f"Bearer {KEY}"})):
        status, reply, _ = raw(keyed.port, method, path, {**headers, "X-Request-Id": given},
                               body=b"{}" if method == "POST" else None)
        got = reply.get("x-request-id", "")
        if echoed is None:
            assert re.fullmatch(r"[0-9a-f]{32}", got), (path, status, got[:200])
        else:
            assert got == echoed, (path, status, got[:200])


def test_request_id_reaches_the_dialect_sanitised(keyed):
    """The OpenAI dialect builds its completion id from the header: it sees the id the server uses."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, headers, reply = raw(keyed.port, "POST", "/v1/completions", {**auth, "X-Request-Id": "y" * 300},
                                 body=body)
    assert status == 200, reply
    rid = headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and f'"cmpl-{rid}"'.encode() in reply
    status, headers, reply = raw(keyed.port, "POST", "/v1/completions", auth, body=body)
    assert status == 200 and f'"cmpl-{headers["x-request-id"]}"'.encode() in reply
