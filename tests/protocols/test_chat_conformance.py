"""Conformance of the chat routes across dialects, in the style of the parser suite: one table of
edge and hostile inputs (``CASES``), every route that takes a prompt or messages and generates
(``ROUTES``) driven by every case it applies to.

Each answer must be the dialect's own: its status, its error envelope with exactly its keys,
and the offending field under the dialect's own wire name (``param`` in the OpenAI envelope; the
message elsewhere). One server serves the whole table: the embedded SmolLM2 with a 64-token
context, so a prompt over the context is a few hundred characters, tokenized in microseconds, and
a ``max_tokens`` that a dialect caps to the room left generates a few dozen tokens at most.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow  # the embedded models, served

MODEL = "m"
CONTEXT = 64                    # --max-model-len: small, so that every length probe is cheap
QUESTION = "What is the capital of France?"
LONG = "The quick brown fox jumps over the lazy dog. " * 20  # about 200 tokens: over the context
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


# -- the dialects' error envelopes ---------------------------------------------------------------
def openai_error(r: httpx.Response) -> tuple[str, str | None]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    code = body["error"]["code"]
    # The status, as vLLM sends it; a prompt over the context carries OpenAI's own name for it.
    assert code == r.status_code or (code == "context_length_exceeded" and "context length" in
                                     body["error"]["message"]), body
    assert isinstance(body["error"]["type"], str), body
    return body["error"]["message"], body["error"]["param"]


def anthropic_error(r: httpx.Response) -> tuple[str, str | None]:
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == {400: "invalid_request_error", 413: "request_too_large"}.get(
        r.status_code, body["error"]["type"]), body
    return body["error"]["message"], None


def bare_error(r: httpx.Response) -> tuple[str, str | None]:
    """Ollama's and KServe's ``{"error": "<message>"}``."""
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"], None


def tgi_error(r: httpx.Response) -> tuple[str, str | None]:
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    if r.status_code == 422:
        assert body["error_type"] == "validation" and body["error"].startswith("Input validation error: "), body
    return body["error"], None


def mindie_error(r: httpx.Response) -> tuple[str, str | None]:
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == ("Input Validation Error" if r.status_code == 422 else "Bad Request"), body
    return body["error"], None


# -- the routes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """A chat route: how to build its body and where the dialect keeps each field."""

    path: str
    build: Callable[[Any], dict]       # the prompt (text, or None for "empty") -> a greedy body
    prompt: str                        # the wire name of the prompt field
    max_tokens: tuple[str, ...]        # where the output budget goes, e.g. ("parameters", "max_new_tokens")
    error: Callable[[httpx.Response], tuple[str, str | None]]
    status: int                        # the dialect's status for a bad field
    caps: bool = False                 # a budget over the room is cut to the room (else refused)
    loads: bool = False                # nothing to generate loads the model (Ollama), not an error
    # What a prompt over the context names: the prompt field (the OpenAI envelope's param), or nothing
    # (vLLM's wording, which the dialects without a param field keep).
    context: str | None = None
    tool_choice: dict[str, Any] | None = None  # a forced call plus a constraint, in the dialect's fields
    ok: Callable[[dict], bool] = lambda body: True  # the dialect's success shape
    head_error: Callable[[httpx.Response], tuple[str, str | None]] | None = None  # refusals before the body

    def with_budget(self, body: dict, tokens: int) -> dict:
        out = json.loads(json.dumps(body))
        node = out
        for key in self.max_tokens[:-1]:
            node = node.setdefault(key, {})
        node[self.max_tokens[-1]] = tokens
        return out


def messages(text: Any) -> list[dict]:
    return [] if text is None else [{"role": "user", "content": text}]


def text_of(text: Any) -> Any:
    return "" if text is None else text


ROUTES: dict[str, Route] = {
    "openai-chat": Route(
        "/v1/chat/completions", lambda t: {"model": MODEL, "messages": messages(t), "temperature": 0},
        "messages", ("max_tokens",), openai_error, 400, caps=True,
        tool_choice={"tools": [WEATHER], "tool_choice": "required",
                     "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        ok=lambda b: b["object"] == "chat.completion", context="messages"),
    "openai-completions": Route(
        "/v1/completions", lambda t: {"model": MODEL, "prompt": text_of(t), "temperature": 0},
        "prompt", ("max_tokens",), openai_error, 400, caps=True, ok=lambda b: b["object"] == "text_completion",
        context="prompt"),
    "responses": Route(
        "/v1/responses", lambda t: {"model": MODEL, "input": messages(t) if t is None else t, "temperature": 0},
        "input", ("max_output_tokens",), openai_error, 400, caps=True,
        tool_choice={"tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": "required",
                     "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}},
        ok=lambda b: b["object"] == "response", context="input"),
    "anthropic": Route(
        "/v1/messages", lambda t: {"model": MODEL, "messages": messages(t), "max_tokens": 8, "temperature": 0},
        "messages", ("max_tokens",), anthropic_error, 400, caps=True,
        tool_choice={"tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                     "tool_choice": {"type": "any"},
                     "output_format": {"type": "json_schema", "schema": SCHEMA}},
        ok=lambda b: b["type"] == "message"),
    "ollama-chat": Route(
        "/api/chat", lambda t: {"model": MODEL, "messages": messages(t), "stream": False,
                                "options": {"temperature": 0}},
        "messages", ("options", "num_predict"), bare_error, 400, caps=True, loads=True,
        ok=lambda b: b["done"] is True),
    "ollama-generate": Route(
        "/api/generate", lambda t: {"model": MODEL, "prompt": text_of(t), "stream": False,
                                    "options": {"temperature": 0}},
        "prompt", ("options", "num_predict"), bare_error, 400, caps=True, loads=True,
        ok=lambda b: b["done"] is True),
    "tgi-generate": Route(
        "/generate", lambda t: {"inputs": text_of(t)}, "inputs", ("parameters", "max_new_tokens"), tgi_error, 422,
        ok=lambda b: isinstance(b["generated_text"], str), context="inputs"),
    "tgi-compat": Route(
        "/", lambda t: {"inputs": text_of(t)}, "inputs", ("parameters", "max_new_tokens"), tgi_error, 422,
        ok=lambda b: isinstance(b[0]["generated_text"], str), context="inputs"),
    # /generate is shared with TGI: told apart by the body, so that a refusal made before the body is
    # read (the HTTP edge's) comes from the route's first dialect, TGI.
    "vllm-generate": Route(
        "/generate", lambda t: {"prompt": text_of(t), "temperature": 0}, "prompt", ("max_tokens",), openai_error,
        400, ok=lambda b: isinstance(b["text"][0], str), head_error=tgi_error, context="prompt"),
    "mindie-infer": Route(
        "/infer", lambda t: {"inputs": text_of(t)}, "inputs", ("parameters", "max_new_tokens"), mindie_error, 422,
        caps=True, ok=lambda b: isinstance(b["generated_text"], str)),
    "triton-generate": Route(
        f"/v2/models/{MODEL}/generate", lambda t: {"text_input": text_of(t)}, "text_input",
        ("parameters", "max_new_tokens"), bare_error, 400, caps=True, ok=lambda b: isinstance(b["text_output"], str)),
}


# -- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One input: ``body(route)`` builds it; the answer is either served (200, the dialect's
    success shape) or refused with ``status(route)`` (the dialect's status for a bad field unless
    given), naming the field ``names(route)`` when that is not None."""

    body: Callable[[Route], dict | bytes]
    served: bool = False
    names: Callable[[Route], str | None] = lambda route: None
    status: Callable[[Route], int] | None = None
    applies: Callable[[Route], bool] = lambda route: True


def short(route: Route, extra: dict | None = None) -> dict:
    """A request that is served: the question, a budget of 4 tokens, ``extra`` on top."""
    return {**route.with_budget(route.build(QUESTION), 4), **(extra or {})}


def nested(route: Route, depth: int = 100_000) -> bytes:
    """The route's body with a prompt nested ``depth`` arrays deep."""
    marker = "\u2603nest\u2603"
    text = json.dumps(route.build(marker))
    return text.replace(json.dumps(marker), "[" * depth + "]" * depth).encode()


CASES: dict[str, Case] = {
    "empty messages or prompt": Case(lambda r: r.with_budget(r.build(None), 4), names=lambda r: r.prompt,
                                     applies=lambda r: not r.loads),
    "empty messages or prompt, Ollama's load request": Case(lambda r: r.build(None), served=True,
                                                            applies=lambda r: r.loads),
    "prompt over the context": Case(lambda r: r.with_budget(r.build(LONG), 4), names=lambda r: r.context),
    "prompt of the wrong type": Case(lambda r: r.with_budget(r.build(12345), 4), names=lambda r: r.prompt),
    "lone surrogate in the prompt": Case(
        lambda r: json.dumps(r.with_budget(r.build("ab\ud800cd"), 4)).encode(), names=lambda r: r.prompt),
    # Too deep to parse: a malformed body, which MindIE answers with 400 "Bad Request".
    "prompt nested 100k deep": Case(nested, names=lambda r: r.prompt,
                                    status=lambda r: 400 if r.error is mindie_error else r.status),
    "unknown field": Case(lambda r: short(r, {"llmserve_no_such_field": {"x": [1, 2]}}), served=True),
    "max_tokens over the room, capped": Case(lambda r: r.with_budget(r.build(QUESTION), 100_000), served=True,
                                             applies=lambda r: r.caps),
    "max_tokens over the room, refused": Case(lambda r: r.with_budget(r.build(QUESTION), 100_000),
                                              names=lambda r: r.max_tokens[-1], applies=lambda r: not r.caps),
    "zero max_tokens": Case(lambda r: r.with_budget(r.build(QUESTION), 0), names=lambda r: r.max_tokens[-1],
                            applies=lambda r: r.path != "/api/chat" and r.path != "/api/generate"),
    "forced tool call plus a constraint": Case(lambda r: short(r, r.tool_choice), names=lambda r: "tool_choice",
                                               applies=lambda r: r.tool_choice is not None),
}

PAIRS = [(c, r) for c in CASES for r in ROUTES if CASES[c].applies(ROUTES[r])]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--device", "cpu", "--max-model-len", str(CONTEXT),
                        "--served-model-name", MODEL, "--max-num-seqs", "4", "--log-level", "warning")
    try:
        yield srv.wait_ready(timeout=300)
    finally:
        log = srv.stop()
        assert "Traceback" not in log, log


def post(server: ServerProcess, route: Route, body: dict | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + route.path, content=content, timeout=120,
                      headers={"Content-Type": "application/json", **headers})


def named(route: Route, message: str, param: str | None, wire: str) -> bool:
    """Whether the error names the field ``wire``: as ``param`` (OpenAI envelope), else in the message."""
    if route.error is openai_error:
        return param == wire or (param or "").startswith(wire + ".")
    return wire in message


@pytest.mark.parametrize("case,route", PAIRS)
def test_chat_route_conformance(server, case, route):
    c, r = CASES[case], ROUTES[route]
    reply = post(server, r, c.body(r))
    if c.served:
        assert reply.status_code == 200, reply.text[:400]
        assert r.ok(reply.json()), reply.text[:400]
        return
    expected = c.status(r) if c.status else r.status
    assert reply.status_code == expected, reply.text[:400]
    message, param = r.error(reply)
    wire = c.names(r)
    if wire is not None:
        assert named(r, message, param, wire), f"{route} {case}: the error does not name {wire!r}: {reply.text[:400]}"
    assert "Traceback" not in message and ".py" not in message


@pytest.mark.parametrize("route", list(ROUTES))
def test_oversize_head_is_refused_in_the_dialects_envelope(server, route):
    """A Content-Type with 10,000 parameters passes the head limit (64 KiB): 431, and the body is the
    route's own error envelope, not plain text."""
    r = ROUTES[route]
    content_type = "application/json" + "".join(f"; p{i}=v{i}" for i in range(10_000))
    reply = post(server, r, short(r), **{"Content-Type": content_type})
    assert reply.status_code == 431, reply.text[:300]
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    message, _ = (r.head_error or r.error)(reply)
    assert "--max-header-bytes" in message


# -- vLLM's own logprob checks, on the same server ------------------------------------------------
def test_logprob_token_ids_are_all_returned(server):
    """vLLM's `logprob_token_ids`: the named tokens' logprobs at every position, all of them."""
    asked = [42, 5000]
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "logprob_token_ids": asked,
            "return_tokens_as_token_ids": True}
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **body, "messages": messages(QUESTION), "logprobs": True, "top_logprobs": 1}).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:42", "token_id:5000"], entry
    done = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={**body, "prompt": QUESTION, "logprobs": 1}).json()
    for token, top in zip(done["choices"][0]["logprobs"]["tokens"], done["choices"][0]["logprobs"]["top_logprobs"]):
        assert {"token_id:42", "token_id:5000", token} == set(top), top


def test_tokens_as_token_ids_name_every_token_and_lead_their_entries(server):
    """vLLM's return_tokens_as_token_ids test: an echoed prompt split inside a character (the emoji is
    several byte-level tokens, each '\ufffd' as text) names every token ``token_id:<int>``, and each
    position's top_logprobs starts with that position's own token."""
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Say 'Hello, world! \U0001f389'", "echo": True, "temperature": 0, "max_tokens": 5,
        "logprobs": 1, "return_tokens_as_token_ids": True}).json()
    lp = reply["choices"][0]["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in lp["tokens"]]
    assert len(ids) == len(lp["tokens"]) and all(token.startswith("token_id:") for token in lp["tokens"])
    assert lp["top_logprobs"][0] is None  # the first prompt token has nothing before it
    assert [next(iter(top)) for top in lp["top_logprobs"][1:]] == lp["tokens"][1:]


@pytest.mark.parametrize("route", ["openai-chat", "openai-completions", "responses", "anthropic", "vllm-generate"])
def test_a_prompt_over_the_context_is_worded_as_clients_parse_it(server, route):
    """OpenAI's clients (Codex) key on ``code: context_length_exceeded``; Claude Code parses
    Anthropic's ``prompt is too long: N tokens > M maximum`` to compact its history; vLLM's own
    route keeps the status as its code."""
    r = ROUTES[route]
    reply = post(server, r, r.with_budget(r.build(LONG), 4))
    assert reply.status_code == 400, reply.text[:400]
    error = reply.json()["error"]
    if route == "anthropic":
        found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
        assert found and int(found.group(1)) > int(found.group(2)), error
    elif route == "vllm-generate":
        assert error["code"] == 400, error
    else:
        assert error["code"] == "context_length_exceeded" and "maximum context length" in error["message"], error
