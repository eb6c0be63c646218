"""API keys, body size and content-type limits, CORS and chat-template caps, on a real server.

One echo-backend server (loopback, uvicorn) with two keys, a 64 KiB body limit, CORS for one
origin and a 0.5 s template cap serves most tests; the official clients of three dialects
must authenticate against it with their own ways of sending headers.
"""

from __future__ import annotations

import httpx
import pytest
from conftest import ECHO_PLUGIN, run_cli, serving

np = pytest.importorskip("numpy")

KEYS = ("key-one-6f1c", "key-two-93ab")
ORIGIN = "https://app.example"
LIMIT = 65536
FOREVER = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
           "{% endfor %}{% endfor %}{% endfor %}")
SIMPLE_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
# The echo model has no chat template of its own; the keyed server trusts request templates.
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "chat_template": SIMPLE_TEMPLATE}


@pytest.fixture(scope="module")
def keyed():
    with serving("--backend", "echo", "--plugin", ECHO_PLUGIN, "--api-key", KEYS[0], "--api-key", KEYS[1],
                 "--max-request-body-bytes", str(LIMIT), "--cors-allow-origins", ORIGIN,
                 "--trust-request-chat-template", "--chat-template-render-timeout", "0.5",
                 "--log-level", "warning", clean_log=True) as server:
        yield server


@pytest.fixture(scope="module")
def plain():
    """Default security settings: no keys, no CORS."""
    with serving("--backend", "echo", "--plugin", ECHO_PLUGIN, "--log-level", "warning") as server:
        yield server


def auth(i: int = 0) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[i]}"}


# -- API keys ------------------------------------------------------------------------------------
def test_probes_are_public_everything_else_needs_a_key(keyed):
    for path in ("/health", "/ready", "/ping"):
        assert httpx.get(keyed.url + path).status_code == 200, path
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/info"),
                         ("GET", "/v2/health/ready"), ("GET", "/no/such/route")):
        r = httpx.request(method, keyed.url + path)
        assert r.status_code == 401, (path, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(keyed.url + "/metrics", headers=auth()).status_code == 200


@pytest.mark.parametrize("path,body,check", [
    ("/v1/chat/completions", CHAT,
     lambda j: j["error"]["type"] == "authentication_error" and j["error"]["code"] == 401),
    ("/generate", {"inputs": "hi"}, lambda j: j["error_type"] == "authentication"),                 # TGI
    ("/generate", {"prompt": "hi"}, lambda j: isinstance(j["error"], str)),                         # shared route
    ("/v2/models/echo/infer", {"inputs": []}, lambda j: set(j) == {"error"}),                       # Triton
    ("/infer", {"inputs": "hi"}, lambda j: "error_type" in j and isinstance(j["error"], str)),       # MindIE
])
def test_refusal_in_each_dialects_format(keyed, path, body, check):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                    {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        r = httpx.post(keyed.url + path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert check(r.json()), r.text
        assert KEYS[0] not in r.text


@pytest.mark.parametrize("headers", [auth(0), auth(1), {"Authorization": f"bearer {KEYS[1]}"}, {"X-Api-Key": KEYS[0]}])
def test_each_key_and_header_style_is_accepted(keyed, headers):
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_openai_client(keyed):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[1], max_retries=0)
    out = client.completions.create(model="echo", prompt="abc", max_tokens=3)
    assert out.choices[0].text == "abc"
    chunks = list(client.chat.completions.create(model="echo", messages=CHAT["messages"], max_tokens=3, stream=True,
                                                 extra_body={"chat_template": SIMPLE_TEMPLATE}))
    assert chunks
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_tgi_client(keyed):
    text_generation = pytest.importorskip("text_generation")
    client = text_generation.Client(keyed.url, headers=auth(0), timeout=30)
    assert client.generate("hey", max_new_tokens=3).generated_text == "hey"
    assert "".join(t.token.text for t in client.generate_stream("yo", max_new_tokens=2)) == "yo"
    with pytest.raises(Exception, match="API key"):
        text_generation.Client(keyed.url, timeout=30).generate("hey", max_new_tokens=3)


def test_triton_client(keyed):
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{keyed.port}")
    inp = httpclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"tri"], dtype=object), binary_data=True)
    headers = {"X-Api-Key": KEYS[1]}
    assert client.is_server_ready(headers=headers)
    result = client.infer("echo", [inp], parameters={"max_new_tokens": 3}, headers=headers)
    assert list(result.as_numpy("text_output")) == [b"tri"]
    with pytest.raises(InferenceServerException, match="API key"):
        client.infer("echo", [inp], parameters={"max_new_tokens": 3})


# -- body size and content type ------------------------------------------------------------------
def _big_chat(size: int) -> bytes:
    return (b'{"messages":[{"role":"user","content":"' + b"a" * size + b'"}],"max_tokens":1,"chat_template":"'
            + SIMPLE_TEMPLATE.encode() + b'"}')


def test_body_over_limit_is_413_by_content_length(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", content=_big_chat(LIMIT + 10),
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413 and str(LIMIT) in r.json()["error"]["message"]
    r = httpx.post(keyed.url + "/generate", content=b'{"inputs":"' + b"a" * (LIMIT + 10) + b'"}',
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error_type"] == "validation"  # TGI's format


@pytest.mark.parametrize("path,make", [
    ("/v1/chat/completions", _big_chat),
    ("/generate", lambda n: b'{"inputs":"' + b"a" * n + b'"}'),          # a shared route, read by hand
    ("/v2/models/echo/infer", lambda n: b'{"inputs":[{"name":"text_input","shape":[1],"datatype":"BYTES","data":["'
                                        + b"a" * n + b'"]}]}'),
])
def test_chunked_body_over_limit_is_413(keyed, path, make):
    body = make(LIMIT + 4096)

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = httpx.post(keyed.url + path, content=chunks(), headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert "content-length" not in r.request.headers
    small = make(100)
    r = httpx.post(keyed.url + path, content=iter([small[:50], small[50:]]),
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type",
                         ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"])
def test_wrong_content_type_is_a_4xx_in_dialect(keyed, content_type):
    body = b'{"prompt":"hi"}'
    r = httpx.post(keyed.url + "/v1/completions", content=body, headers={**auth(), "Content-Type": content_type})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(keyed.url + "/generate", content=b'{"inputs":"hi"}',
                   headers={**auth(), "Content-Type": content_type})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    # JSON with a charset, and +json types, are JSON
    r = httpx.post(keyed.url + "/v1/chat/completions", content=_big_chat(2),
                   headers={**auth(), "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("path,status,check", [
    ("/v1/chat/completions", 400, lambda j: j["error"]["type"] == "invalid_request_error"),
    ("/v1/completions", 400, lambda j: j["error"]["type"] == "invalid_request_error"),
    ("/generate", 422, lambda j: j["error_type"] == "validation"),
    ("/generate_stream", 422, lambda j: j["error_type"] == "validation"),
    ("/v2/models/echo/infer", 400, lambda j: set(j) == {"error"}),
    ("/infer", 400, lambda j: "error_type" in j),
])
@pytest.mark.parametrize("body", [b"not json", b'{"unterminated": ', b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_non_json_body_is_a_4xx_in_dialect(keyed, path, status, check, body):
    r = httpx.post(keyed.url + path, content=body, headers={**auth(), "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if body in (b"not json", b'{"unterminated": '):
        assert r.status_code == status, r.text
    assert check(r.json()), r.text


# -- CORS ----------------------------------------------------------------------------------------
def test_cors_preflight_for_allowed_origin(keyed):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=pre)  # browsers send no key here
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.options(keyed.url + "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # the real request carries the header too, even when refused
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_by_default(plain):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(plain.url + "/v1/chat/completions", headers=pre)
    assert not any(h.startswith("access-control-") for h in r.headers), dict(r.headers)
    r = httpx.post(plain.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert r.status_code == 200  # no keys configured: open, as before
    assert not any(h.startswith("access-control-") for h in r.headers)


def test_cors_wildcard_with_credentials_is_refused_at_startup():
    result = run_cli("serve", "--backend", "echo", "--plugin", ECHO_PLUGIN, "--cors-allow-origins", "*",
                     "--cors-allow-credentials", timeout=60)
    assert result.returncode != 0
    assert "--cors-allow-credentials cannot be combined with --cors-allow-origins '*'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# -- chat templates ------------------------------------------------------------------------------
@pytest.mark.parametrize("template",
                         [FOREVER, "{{ 'x' * 100000000000 }}",
                          "{% for i in range(100000) %}{{ 'y' * 999999 }}{% endfor %}"])
def test_runaway_chat_template_is_a_400_and_the_server_keeps_serving(keyed, template):
    r = httpx.post(keyed.url + "/v1/chat/completions", json={**CHAT, "chat_template": template}, headers=auth(),
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
