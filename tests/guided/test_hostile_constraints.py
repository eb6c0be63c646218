"""Output constraints under every spelling, and hostile ones, against the real SmolLM2 server.

Every spelling (``guided_*``, ``structured_outputs``, ``response_format``, TGI ``grammar``)
constrains; two at once, unknown keys and unsupported backends are 400s naming the field; the
inputs of the advisories against peers (invalid schemas and regexes, automaton blow-ups,
huge or deep schemas, bad tool patterns) are 400s with ``param``, answered quickly; while a
client sends the worst of them in a loop, ordinary requests still complete; once such
clients have gone, the server's CPU use returns to idle.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import pytest

from conftest import serving

CHAT = {"messages": [{"role": "user", "content": "Give me a word."}], "max_tokens": 12, "temperature": 0}
def nested(levels: int) -> dict:
    return json.loads('{"type":"object","properties":{"a":' * levels + '{"type":"integer"}' + "}}" * levels)


DEEP = nested(300)  # past the body's own nesting cap too: refused naming the top-level field
DEEP40 = nested(40)  # 81 levels of JSON: within the body's cap, past --guided-max-depth (64)
SLOW_REGEXES = ["(a|b)*a(a|b){13}", "(a|b)*a(a|b){14}", "(a|b)*b(a|b){13}", "(b|a)*a(a|b){13}"]


@pytest.fixture(scope="module")
def server():
    with serving("--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
                 "--log-level", "warning", "--guided-compile-timeout", "3", timeout=300) as server:
        yield server


@pytest.fixture(autouse=True)
def server_log_when_failed(request, server):
    """A failed test shows the server's last log lines (its guided-decoding warnings say whether
    a compilation overran its budget or had to be left behind)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print("server log, last 80 lines:\n" + "".join(server.log.splitlines(True)[-80:]))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def chat(http, **extra):
    return http.post("/v1/chat/completions", json={**CHAT, **extra})


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# -- every spelling constrains -------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"]}


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_additional_properties": True}},
    {"guided_json": SCHEMA},
    {"guided_json": SCHEMA, "guided_decoding_backend": "lm-format-enforcer"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
])
def test_json_spellings_constrain(http, extra):
    value = json.loads(text_of(chat(http, **extra)))
    assert set(value) == {"word"} and isinstance(value["word"], str)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json_object": True}},
    {"response_format": {"type": "json_object"}},
])
def test_json_object_spellings(http, extra):
    messages = [{"role": "user", "content": 'Reply with a JSON object like {"name": "Ann"}.'}]
    reply = chat(http, messages=messages, max_tokens=64, **extra)
    assert reply.json()["choices"][0]["finish_reason"] == "stop", reply.text
    assert isinstance(json.loads(text_of(reply)), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, re.compile(r"[0-9]{3}-[a-z]{2}").fullmatch),
    ({"guided_regex": "(yes|no)!"}, re.compile(r"(yes|no)!").fullmatch),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, {"red", "green", "blue"}.__contains__),
    ({"guided_choice": ["alpha", "beta"]}, {"alpha", "beta"}.__contains__),
])
def test_regex_and_choice_spellings(http, extra, check):
    assert check(text_of(chat(http, **extra)))
    body = {"prompt": "Answer:", "max_tokens": 12, "temperature": 0, **extra}  # completions too
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200 and check(reply.json()["choices"][0]["text"]), reply.text


def test_tgi_grammar_constrains(http):
    reply = http.post("/generate", json={"inputs": "Pick:", "parameters": {
        "max_new_tokens": 8, "grammar": {"type": "regex", "value": "(left|right)"}}})
    assert reply.status_code == 200 and reply.json()["generated_text"] in ("left", "right"), reply.text


def test_vllm_native_generate_structured_outputs(http):
    body = {"prompt": "Pick:", "max_tokens": 8, "temperature": 0}
    reply = http.post("/generate", json={**body, "structured_outputs": {"choice": ["up", "down"]}})
    assert reply.status_code == 200 and reply.json()["text"][0] in ("Pick:up", "Pick:down"), reply.text
    reply = http.post("/generate", json={**body, "guided_regex": "[0-9]{2}"})
    assert reply.status_code == 200 and re.fullmatch(r"Pick:[0-9]{2}", reply.json()["text"][0]), reply.text
    for extra, param in [({"structured_outputs": {"foo": 1}}, "structured_outputs.foo"),
                         ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
                         ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
                         ({"guided_jsn": {}}, "guided_jsn")]:
        reply = http.post("/generate", json={**body, **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


# -- refusals ------------------------------------------------------------------------------------
def error_of(reply, status=400) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"foo": 1}}, "structured_outputs.foo"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": SCHEMA, "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": False, "regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_jsonn": SCHEMA}, "guided_jsonn"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structural_tag": "{}"}, "structural_tag"),
])
def test_unknown_unsupported_and_doubled_constraints_are_400s(http, extra, param):
    error = error_of(chat(http, **extra))
    assert error["param"] == param, error


HOSTILE = [
    ({"guided_json": {"type": "object", "properties": {"foo": "bar"}}}, "guided_json"),
    ({"guided_regex": "foo**"}, "guided_regex"),
    ({"guided_regex": "[.*"}, "guided_regex"),
    ({"guided_regex": "a{100000}"}, "guided_regex"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_regex": "|".join(f"w{i}" for i in range(10000))}, "guided_regex"),
    ({"guided_regex": "(a|b)*a(a|b){13}"}, "guided_regex"),
    ({"guided_choice": [f"choice {i}" for i in range(10000)]}, "guided_choice"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10000)}}},
     "guided_json"),
    ({"guided_json": {"type": "string", "enum": [f"v{i}" for i in range(100000)]}}, "guided_json"),
    ({"guided_json": {"type": "string", "pattern": "(a|b)*a(a|b){13}"}}, "guided_json"),
    ({"guided_json": DEEP}, "guided_json"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ({"structured_outputs": {"json": DEEP40}}, "structured_outputs.json"),
    ({"guided_json": DEEP40}, "guided_json"),
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DEEP}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[.*"}}}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "foo**"}}}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(a|b)*a(a|b){14}"}}}}}],
      "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("extra, param", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_constraints_are_quick_400s(http, extra, param):
    started = time.monotonic()
    error = error_of(chat(http, **extra))
    assert error["param"] == param, error
    assert time.monotonic() - started < 20  # the compile budget is 3s here; static bounds answer at once


@pytest.mark.parametrize("grammar, param", [
    ({"type": "regex", "value": "(a{1000}){1000}"}, "grammar"),
    ({"type": "regex", "value": "foo**"}, "grammar"),
    ({"type": "json", "value": DEEP40}, "grammar"),
    ({"type": "json", "value": {"type": "object", "properties": {"foo": "bar"}}}, "grammar"),
])
def test_tgi_grammar_refusals(http, grammar, param):
    reply = http.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": grammar}})
    # TGI answers validation errors with 422.
    assert reply.status_code == 422 and reply.json()["error_type"] == "validation", reply.text
    assert "grammar is not valid" in reply.json()["error"]


# -- the server stays usable ---------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_ordinary_requests_complete_while_hostile_constraints_loop(server, http):
    text_of(chat(http, guided_choice=["yes", "no"]))  # the decoder's tokenizer tables are built once, first
    baseline = []
    for _ in range(2):
        started = time.monotonic()
        text_of(chat(http))
        baseline.append(time.monotonic() - started)
    stop = threading.Event()
    sent = []

    def attacker(offset: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            i = offset
            while not stop.is_set():
                # Distinct slow regexes each time (a repeated one is refused from memory).
                regex = SLOW_REGEXES[i % len(SLOW_REGEXES)] + f"x{{{i % 50}}}"
                client.post("/v1/chat/completions", json={**CHAT, "guided_regex": regex})
                sent.append(regex)
                i += 2
    threads = [threading.Thread(target=attacker, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        during = []
        for _ in range(3):
            started = time.monotonic()
            text_of(chat(http))
            during.append(time.monotonic() - started)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert sent, "the hostile client sent nothing"
    # Generous: the compile worker competes for the interpreter lock, but never blocks a request.
    assert max(during) < max(20.0, 6 * max(baseline)), (baseline, during)


def test_cpu_returns_to_idle_after_hostile_clients_leave(server):
    # Clients that send slow constraints and hang up at once.
    for i, regex in enumerate(SLOW_REGEXES):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/chat/completions", timeout=0.3,
                       json={**CHAT, "guided_regex": regex + f"y{{{i + 3}}}"})
    time.sleep(1.5)  # the compile worker notices its waiters have gone and stops
    before = _cpu_seconds(server.proc.pid)
    time.sleep(3.0)
    used = _cpu_seconds(server.proc.pid) - before
    assert used < 0.9, f"the server used {used:.2f} CPU-s in 3 s of idleness"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
