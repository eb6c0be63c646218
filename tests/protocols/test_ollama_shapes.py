"""The Ollama dialect on the echo backend (the model "says" its prompt back), in process, with
the real ``ollama`` client riding the test app's transport: routes and their shapes, the
error format and status codes, the parsing path of tool calls (hermes) and the tool-result
round trip into the chat template, model-name rules, API keys, the OpenAPI document."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
# The echo model repeats its prompt: with this template it "says" every message, tool names included.
ECHO_TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.tool_name %}[{{ m.tool_name }}]{% endif %}: "
                 "{{ m.content }}{% for c in m.tool_calls or [] %} call {{ c.function.name }} "
                 "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
LAST_USER = "{{ messages[-1].content }}"


class AppTransport(httpx.BaseTransport):
    """Hands the client's requests to the in-process test app (whole bodies: streams arrive at once)."""

    def __init__(self, app) -> None:
        self.app = app

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.app.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


def ollama_client(app, **kwargs) -> ollama.Client:
    """The real client, sending through the in-process app."""
    return ollama.Client(host="http://testserver", transport=AppTransport(app), **kwargs)


@pytest.fixture
def make(echo_app):
    def start(template: str | None = ECHO_TEMPLATE, **flags):
        app, context = echo_app(**flags)
        context.engine.tokenizer.chat_template = template  # this test's echo model has a chat template
        return app, context
    return start


def test_probe_version_tags_show_ps(make):
    app, _ = make()
    assert app.get("/").text == "Ollama is running" and app.get("/").headers["content-type"].startswith("text/plain")
    assert app.head("/").status_code == 200 and app.head("/api/tags").status_code == 200
    assert app.head("/api/version").status_code == 200
    assert app.post("/", json={"inputs": "hi"}).status_code == 200  # POST / is still TGI's
    client = ollama_client(app)
    models = client.list().models
    assert [m.model for m in models] == ["echo:latest"]
    assert models[0].details.quantization_level == "F32" and len(models[0].digest) == 64
    shown = client.show("echo:latest")
    assert shown.capabilities == ["completion"] and shown.template == ECHO_TEMPLATE
    assert shown.modelinfo["llm.context_length"] == 512
    running = client.ps().models
    assert running[0].model == "echo:latest" and running[0].context_length == 512
    version = app.get("/api/version").json()
    # A current Ollama release (clients such as codex --oss refuse old ones), llmserve's own beside it.
    assert tuple(int(p) for p in version["version"].split(".")) >= (0, 13, 0) and version["llmserve"]


def test_chat_and_generate_shapes(make):
    app, _ = make(LAST_USER)
    client = ollama_client(app)
    reply = client.chat(model="echo", messages=[{"role": "user", "content": "hello there"}])
    assert reply.message.role == "assistant" and reply.message.content == "hello there"
    assert reply.done and reply.done_reason == "stop" and reply.prompt_eval_count == 11 and reply.eval_count == 12
    assert reply.total_duration >= reply.eval_duration >= 0 and reply.load_duration == 0
    chunks = list(client.chat(model="echo", messages=[{"role": "user", "content": "abc"}], stream=True))
    assert "".join(c.message.content for c in chunks) == "abc"
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True] and chunks[-1].eval_count == 4
    r = app.post("/api/generate", json={"model": "echo", "prompt": "hi", "options": {"num_predict": 1}})
    assert r.headers["content-type"] == "application/x-ndjson"  # stream is the default
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "length" and lines[0]["response"] == "h"
    first = client.generate(model="echo", prompt="hi")  # the chat template frames the prompt
    assert first.response == "hi" and first.context == list(b"hihi")  # prompt + output, EOS dropped
    follow = client.generate(model="echo", prompt="!", context=first.context, raw=True)
    assert follow.response == "hihi!" and follow.context is None  # raw: no context back, as in Ollama
    templated = client.generate(model="echo", prompt="P", system="S",
                                template="{{ if .System }}<{{ .System }}>{{ end }}{{ .Prompt }}={{ .Response }}IGNORED")
    assert templated.response == "<S>P="


def test_empty_requests_load_the_model(make):
    app, _ = make()
    client = ollama_client(app)
    assert client.chat(model="echo", messages=[]).done_reason == "load"
    assert client.generate(model="echo", keep_alive=0).done_reason == "unload"


def test_tool_call_parsing_and_round_trip(make):
    app, _ = make(LAST_USER, enable_auto_tool_choice=True, tool_call_parser="hermes")
    client = ollama_client(app)
    reply = client.chat(model="echo", messages=[{"role": "user", "content": "Checking. " + CALL}], tools=TOOLS)
    assert reply.message.content == "Checking."
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Zürich"}  # an object
    streamed = list(client.chat(model="echo", messages=[{"role": "user", "content": CALL}], tools=TOOLS,
                                stream=True))
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Zürich"})]
    assert "<tool_call>" not in "".join(c.message.content for c in streamed)
    assert "tools" in client.show("echo").capabilities
    # The tool result goes back as role "tool" with tool_name, and reaches the chat template.
    history = [{"role": "user", "content": "Weather?"}, reply.message,
               {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"}]
    app2, _ = make(ECHO_TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")
    said = ollama_client(app2).chat(model="echo", messages=history, tools=TOOLS).message.content
    assert 'assistant: Checking. call get_weather {"city": "Zürich"}' in said
    assert "tool[get_weather]: 18 degrees" in said


def test_errors_are_ollama_shaped_with_ollama_statuses(make):
    app, _ = make()
    client = ollama_client(app)
    cases = [
        ({"model": "echo", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "think": True}, "does not support thinking"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "think": "max"}, "invalid think value"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, "does not support tools"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "format": "yaml"}, "invalid format"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "options": {"temperature": -1}},
         "options.temperature"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 0}},
         "num_predict"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "options": {"num_ctx": 3}}, "num_ctx"),
        ({"model": "echo", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "echo", "messages": "hi"}, "messages"),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}], "format": {"type": "nonsense"}}, "format"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model is required"),
    ]
    for body, words in cases:
        r = app.post("/api/chat", json=body)
        assert r.status_code == 400 and set(r.json()) == {"error"} and words in r.json()["error"], (body, r.text)
    for body, words in [({"model": "echo", "prompt": "x", "suffix": "y"}, "suffix"),
                        ({"model": "echo", "prompt": "x", "images": ["aGk="]}, "images"),
                        ({"model": "echo", "prompt": "x", "template": "{{ range .Messages }}"}, "range"),
                        ({"model": "echo", "prompt": "x", "context": [10**9]}, "out of vocabulary")]:
        r = app.post("/api/generate", json=body)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    assert app.post("/api/chat", content=b"{not json").status_code == 400
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="echo", prompt="x", suffix="y")
    assert info.value.status_code == 400 and "suffix" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model="echo", input="x")
    assert info.value.status_code == 400 and "--task embed" in info.value.error


def test_model_management_is_refused_without_touching_disk(make, tmp_path):
    app, _ = make()
    client = ollama_client(app)
    for call in (lambda: client.pull("llama3"), lambda: client.push("me/model"), lambda: client.delete("echo"),
                 lambda: client.copy("echo", "other"), lambda: client.create("new", from_="echo")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 403 and "does not manage models" in info.value.error
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ollama.ResponseError) as info:
        client.create_blob(blob)
    assert info.value.status_code == 403
    assert app.head("/api/blobs/sha256:" + "0" * 64).status_code == 403
    assert app.post("/api/blobs/sha256:../../etc/passwd", content=b"x").status_code in (403, 404)


def test_model_names(make):
    app, _ = make(LAST_USER, strict_model_name=True, served_model_name=["smol"])
    client = ollama_client(app)
    assert client.chat(model="smol:latest", messages=[{"role": "user", "content": "a"}]).model == "smol:latest"
    assert client.generate(model="smol", prompt="a").response
    for name in ("other", "smol:7b"):
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model=name, messages=[{"role": "user", "content": "a"}])
        assert info.value.status_code == 404 and info.value.error == f'model "{name}" not found, try pulling it first'
    with pytest.raises(ollama.ResponseError) as info:
        client.show("other")
    assert info.value.status_code == 404
    lenient, _ = make(LAST_USER)  # one served name, not strict: any name maps to it, as on every route
    assert ollama_client(lenient).generate(model="llama3.2:1b", prompt="a").model == "llama3.2:1b"


def test_api_keys_cover_the_dialect(make):
    app, _ = make(api_key=["sekret"])
    r = app.get("/api/tags")
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert app.post("/api/chat", json={"model": "echo", "messages": []}).status_code == 401
    keyed = ollama_client(app, headers={"Authorization": "Bearer sekret"})
    assert keyed.list().models[0].model == "echo:latest"


def test_openapi_lists_every_route(make):
    app, _ = make()
    paths = app.get("/openapi.json").json()["paths"]
    expected = {"/": {"get", "head", "post"}, "/api/version": {"get", "head"}, "/api/tags": {"get", "head"},
                "/api/ps": {"get"}, "/api/show": {"post"}, "/api/chat": {"post"}, "/api/generate": {"post"},
                "/api/embed": {"post"}, "/api/embeddings": {"post"}, "/api/pull": {"post"}, "/api/push": {"post"},
                "/api/create": {"post"}, "/api/copy": {"post"}, "/api/delete": {"delete"},
                "/api/blobs/{digest}": {"head", "post"}}
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
    chat = paths["/api/chat"]["post"]["responses"]
    assert "application/x-ndjson" in chat["200"]["content"]
    assert chat["4XX"]["content"]["application/json"]["schema"]["required"] == ["error"]
