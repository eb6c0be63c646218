"""The ``web`` dialect's routes without a browser: ``GET /`` told apart by ``Accept`` (a page for
browsers, Ollama's answer for its clients), the pages and assets public and local, the API behind
the key, and the negotiation rules of the core (``llmserve.server.negotiation``)."""

from __future__ import annotations

import re

import pytest
from fastapi import APIRouter
from starlette.responses import PlainTextResponse

from llmserve.errors import ConfigError
from llmserve.server.negotiation import answers_media, prefers
from llmserve.server.protocol import Protocol

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
KEY = "web-key-31a"


@pytest.mark.parametrize("accept, html", [
    (BROWSER, True), ("text/html", True), ("text/*", True), ("*/*", False), ("", False),
    ("application/json", False), ("application/json, text/html;q=0.5", False), ("text/html;q=0", False),
    ("application/json;q=0.4, text/html;q=0.9", True), ("text/html;q=bogus", False),
])
def test_prefers_reads_the_accept_header(accept, html):
    assert prefers(accept, "text/html") is html


def test_get_root_answers_browsers_with_the_playground_and_clients_with_ollama(echo_app):
    client, _ = echo_app()
    page = client.get("/", headers={"Accept": BROWSER})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>llmserve playground</title>" in page.text and "Accept" in page.headers["vary"]
    for accept in (None, "*/*", "application/json"):  # curl, SDKs, the ollama client
        answer = client.get("/", headers={"Accept": accept} if accept else {})
        assert answer.status_code == 200 and answer.text == "Ollama is running"
    head = client.head("/", headers={"Accept": BROWSER})
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/html") and head.content == b""
    assert client.get("/playground").text == page.text  # the same page under a name of its own


def test_ollama_client_still_finds_its_server(server_process):
    ollama = pytest.importorskip("ollama")
    from conftest import ECHO_PLUGIN

    server = server_process("--plugin", ECHO_PLUGIN, "--backend", "echo", "--log-level", "warning")
    client = ollama.Client(host=server.url)
    assert [m.model for m in client.list().models]  # the client's own calls are unchanged
    import httpx

    assert httpx.get(server.url + "/").text == "Ollama is running"  # what `curl host:port/` prints
    assert "<!doctype html>" in httpx.get(server.url + "/", headers={"Accept": BROWSER}).text


def test_pages_and_assets_need_no_key_but_the_api_does(echo_app):
    client, _ = echo_app(api_key=[KEY])
    assert client.get("/", headers={"Accept": BROWSER}).status_code == 200
    for path in ("/playground", "/docs", "/redoc", "/assets/playground.js", "/assets/playground.css",
                 "/assets/docs.js", "/assets/swagger-ui-bundle.js", "/assets/swagger-ui.css",
                 "/assets/redoc.standalone.js", "/assets/favicon.png"):
        response = client.get(path)
        assert response.status_code == 200 and response.content, path
    # A browser's Accept does not open the API: what the page calls needs the key.
    for path in ("/v1/models", "/metrics", "/openapi.json", "/api/tags"):
        assert client.get(path, headers={"Accept": BROWSER}).status_code == 401, path
    assert client.get("/").status_code == 401  # Ollama's GET / keeps its rule (the key)
    refused = client.post("/v1/chat/completions", headers={"Accept": BROWSER},
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]


def test_assets_are_a_fixed_list(echo_app):
    client, _ = echo_app()
    for name in ("nope.js", "..%2Fprotocol.py", "%2e%2e%2fprotocol.py", "protocol.py", "playground.html"):
        response = client.get("/assets/" + name)
        assert response.status_code == 404, name
        assert response.json()["error"]["type"] == "not_found_error"
    js = client.get("/assets/playground.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert client.get("/assets/swagger-ui.css").headers["content-type"].startswith("text/css")


def test_pages_reference_only_the_server_itself(echo_app):
    client, _ = echo_app()
    for path in ("/playground", "/docs", "/redoc"):
        response = client.get(path)
        html = response.text
        refs = re.findall(r"""(?:src|href|content)=["']([^"']*)["']""", html)
        assert refs, path
        assert not [r for r in refs if re.match(r"(?i)(https?:)?//", r)], (path, refs)
        assert "default-src 'self'" in response.headers["content-security-policy"]
    for name in ("playground.js", "docs.js"):
        script = client.get("/assets/" + name).text
        assert not re.search(r"""["'](https?:)?//""", script), name  # no absolute URL in our own scripts
    assert 'content="/openapi.json"' in client.get("/docs").text


def test_pages_follow_the_root_path_and_a_prefix(echo_app):
    client, _ = echo_app(protocol_prefix={"web": "/ui"})
    page = client.get("/ui/", headers={"Accept": BROWSER})
    assert page.status_code == 200 and 'href="assets/playground.css"' in page.text  # /ui/assets/...
    assert client.get("/ui/assets/playground.css").status_code == 200
    assert client.get("/", headers={"Accept": BROWSER}).text == "Ollama is running"  # the root is Ollama's alone
    from fastapi.testclient import TestClient

    # Behind a proxy that strips /llm (uvicorn's root_path, from --root-path): the pages' API calls
    # and the docs' document carry it.
    with TestClient(client.app, root_path="/llm") as rooted:
        assert 'content="/llm/openapi.json"' in rooted.get("/ui/docs").text
        assert 'name="llmserve-root" content="/llm"' in rooted.get("/ui/playground").text


class _Pages(Protocol):
    """Two negotiated routes on one path are a clash, like two plain ones."""

    def router(self) -> APIRouter:
        router = APIRouter()

        @answers_media("text/html")
        async def page() -> PlainTextResponse:
            return PlainTextResponse("page")

        router.add_api_route("/", page, methods=["GET"])
        return router


def test_two_routes_for_one_media_type_clash(echo_app):
    from llmserve.server.app import build_app

    _, context = echo_app()
    protocols = {"one": _Pages(context), "two": _Pages(context)}
    with pytest.raises(ConfigError, match=r"GET / \(text/html\) is claimed by both protocol 'one' and protocol 'two'"):
        build_app(context, protocols)
    app = build_app(context, {"one": _Pages(context)})  # alone, it answers the requests that prefer it
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/", headers={"Accept": "text/html"}).text == "page"
        assert client.get("/").status_code == 404
