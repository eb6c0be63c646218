"""Malformed values on every JSON route of every dialect, found at run time in the app's OpenAPI
document (so a dialect added later is covered without editing this file): lone UTF-16
surrogates, nesting past the depth limit, strings and booleans in numeric or boolean fields,
non-finite numbers, integers past 64 bits and numbers past a declared range. Each is a 4xx
naming the problem (never a 5xx), in the dialect's own format (its ``error_schema``).

Bodies are built from each route's request schema: its required fields with plain values,
plus the one bad value under test, so that the bad value is the body's only fault.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import httpx
import jsonschema
import pytest

from llmserve.server.dialect_kit import MAX_JSON_DEPTH
from llmserve.server.openapi import OPENAI_ERROR_SCHEMA

from conftest import ECHO_PLUGIN

from .conftest import InProcServer

MODEL = "echo"
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|site-packages| at 0x[0-9a-f]+")


@pytest.fixture(scope="module")
def server():
    srv = InProcServer(backend="echo", plugins=[ECHO_PLUGIN], served_model_name=[MODEL],
                       trust_request_chat_template=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(client) -> dict[str, Any]:
    return client.get("/openapi.json").json()


class Schemas:
    """The OpenAPI document's schemas, with ``$ref`` resolved."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.components = doc.get("components", {}).get("schemas", {})

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def alternatives(self, schema: dict[str, Any]) -> list[dict[str, Any]]:
        """The non-null members of an anyOf / oneOf (the schema itself otherwise), resolved."""
        schema = self.resolve(schema)
        members = schema.get("anyOf") or schema.get("oneOf") or [schema]
        return [self.resolve(m) for m in members if self.resolve(m).get("type") != "null"]

    def minimal(self, schema: dict[str, Any]) -> Any:
        """A plain value that satisfies ``schema``'s types (required fields only)."""
        schema = self.alternatives(schema)[0] if self.alternatives(schema) else {}
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return schema["enum"][0]
        kind = schema.get("type")
        if kind == "object" or "properties" in schema:
            props = schema.get("properties", {})
            # No required field (a body told apart by which fields it has): its text fields.
            names = schema.get("required") or [n for n, p in props.items()
                                               if {m.get("type") for m in self.alternatives(p)} == {"string"}]
            return {name: self.minimal(props.get(name, {})) for name in names}
        if kind == "array":
            return [self.minimal(schema.get("items", {})) for _ in range(max(1, schema.get("minItems", 1)))]
        if kind == "integer":
            return max(1, int(schema.get("minimum", 1)))
        if kind == "number":
            return 1.0
        if kind == "boolean":
            return False
        return "hi"

    def scalar_kind(self, schema: dict[str, Any]) -> str | None:
        """"integer", "number" or "boolean" when a field takes only that (or null)."""
        kinds = {m.get("type") for m in self.alternatives(schema)}
        return kinds.pop() if len(kinds) == 1 and kinds <= {"integer", "number", "boolean"} else None


def json_routes(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(concrete path, body schema) of every POST route whose body is JSON."""
    schemas = Schemas(doc)
    for path, ops in sorted(doc["paths"].items()):
        schema = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            continue
        concrete = path.replace("{model_name}", MODEL).replace("{model_version}", "1")
        for alternative in schemas.alternatives(schema):  # a shared route: one body shape per dialect
            yield concrete, alternative


def route_ids(doc: dict[str, Any]) -> list[str]:
    return [f"{p}#{i}" for i, (p, _) in enumerate(json_routes(doc))]


@pytest.fixture(scope="module")
def routes(openapi) -> list[tuple[str, dict[str, Any]]]:
    found = list(json_routes(openapi))
    # The built-in dialects' generation routes must be among them, or the enumeration is broken.
    paths = {p for p, _ in found}
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/infer", f"/v2/models/{MODEL}/generate",
            f"/v2/models/{MODEL}/infer", "/tokenize", "/api/chat", "/api/generate", "/v1/messages",
            "/v1/responses"} <= paths, paths
    return found


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text.encode("utf-8"), headers={"Content-Type": "application/json"})


def error_schemas(server: InProcServer) -> list[dict[str, Any]]:
    """The error formats the served dialects declare (a shared route answers in one of them)."""
    registry = server.context.registry
    declared = [registry.load("protocol", name).error_schema for name in registry.names("protocol")]
    return [OPENAI_ERROR_SCHEMA, *(s for s in declared if s)]


def check_4xx(server: InProcServer, path: str, r: httpx.Response, *needles: str) -> None:
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
    assert not LEAKS.search(r.text), r.text[:300]
    body = r.json()
    assert isinstance(body, dict) and body, r.text[:300]
    assert any(jsonschema.Draft202012Validator(s).is_valid(body) for s in error_schemas(server)), body
    text = r.text.lower()
    for needle in needles:
        assert needle.lower() in text, (path, needle, r.text[:300])


# -- lone surrogates ------------------------------------------------------------------------
def test_lone_surrogates_anywhere_are_a_4xx_on_every_json_route(server, client, openapi, routes):
    schemas = Schemas(openapi)
    for path, schema in routes:
        body = schemas.minimal(schema)
        # json.dumps escapes the surrogate as \ud800: exactly what a hostile client sends.
        for bad in ({**body, "zz_extra": "a\ud800b"}, {**body, "zz_extra": {"k\udfff": 1}},
                    {**body, "zz_extra": ["x", ["\udfff"]]}):
            check_4xx(server, path, post_raw(client, path, json.dumps(bad)), "surrogate")
        for name, value in body.items():  # the route's own required string fields
            if isinstance(value, str):
                r = post_raw(client, path, json.dumps({**body, name: "hi \ud800 there"}))
                check_4xx(server, path, r, "surrogate", name)
        # Raw UTF-8 bytes of a surrogate (ED A0 80) are not UTF-8 text either.
        raw = json.dumps({**body, "zz_extra": "@@"}).encode().replace(b"@@", b"\xed\xa0\x80")
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])


def test_surrogate_pairs_are_ordinary_text(client):
    # A valid pair (an emoji, escaped) is one character, not a lone surrogate.
    r = post_raw(client, "/v1/completions", json.dumps({"model": MODEL, "prompt": "ok \U0001F600", "max_tokens": 3}))
    assert r.status_code == 200, r.text


# -- nesting --------------------------------------------------------------------------------
def nested(depth: int, leaf: str = "1", kind: str = "array") -> str:
    return ("[" * depth + leaf + "]" * depth) if kind == "array" else ('{"a":' * depth + leaf + "}" * depth)


def test_deep_nesting_is_a_4xx_on_every_json_route(server, client, openapi, routes):
    schemas = Schemas(openapi)
    for path, schema in routes:
        base = json.dumps(schemas.minimal(schema))[:-1]  # "{...": room for one more field
        sep = ", " if base != "{" else ""
        for text in (nested(100_000), nested(50_000, kind="object"),          # whole bodies
                     f'{base}{sep}"zz_deep": {nested(5_000)}}}',             # a value past the parser's reach
                     f'{base}{sep}"zz_deep": {nested(MAX_JSON_DEPTH + 5, kind="object")}}}'):  # one it can read
            check_4xx(server, path, post_raw(client, path, text), "nested too deeply")
        # Just under the limit is fine as far as nesting goes (the extra field is ignored).
        r = post_raw(client, path, f'{base}{sep}"zz_deep": {nested(MAX_JSON_DEPTH - 10)}}}')
        assert r.status_code < 500 and "nested too deeply" not in r.text, (path, r.text[:300])


def test_deep_nesting_names_the_field(server, client):
    r = post_raw(client, "/v1/chat/completions",
                 '{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "tools": '
                 f'[{{"type": "function", "function": {{"name": "f", "parameters": {nested(300, kind="object")}}}}}]}}')
    check_4xx(server, "/v1/chat/completions", r, "nested too deeply")
    assert r.json()["error"]["param"] == "tools"
    data = nested(1000, '"hi"')
    r = post_raw(client, f"/v2/models/{MODEL}/infer",
                 '{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ' + data + "}]}")
    check_4xx(server, "/infer", r, "nested too deeply")


def test_deep_json_text_inside_a_field_is_a_4xx(server, client):
    # JSON sent as a string (tool-call arguments in the history, a schema as text) is decoded
    # by the route; past Python's recursion limit that is the request's fault, not a 500.
    deep = nested(5_000)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 2,
                                                 "chat_template": "{{ messages[0]['content'] }}"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": history[:1], "guided_json": deep}),
                       ("/generate", {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": deep}}})):
        check_4xx(server, path, client.post(path, json=body), "nest")


# -- strict types and ranges ----------------------------------------------------------------
BAD_SCALARS: dict[str, list[str]] = {
    # JSON text of values no field of that kind accepts (1e999 parses as infinity in Python).
    "integer": ['"10"', "true", "1.5", "1" + "0" * 30, "-1" + "0" * 30],
    "number": ['"1.0"', "true", "1e999", "-1e999", "NaN", "Infinity"],
    "boolean": ['"yes"', '"true"', "1", "0"],
}


Field = tuple[tuple[str, ...], str, dict, Any]


def scalar_fields(schemas: Schemas, schema: dict[str, Any]) -> Iterator[Field]:
    """(path, kind, field schema, parent value) of every scalar field, top level and one object
    down (the parent: a minimal object of the schema holding the field, or None at top level)."""
    props = schemas.resolve(schema).get("properties", {})
    for name, field in props.items():
        kind = schemas.scalar_kind(field)
        if kind is not None:
            yield (name,), kind, schemas.alternatives(field)[0], None
            continue
        for alt in schemas.alternatives(field):
            for sub, sub_field in alt.get("properties", {}).items():
                sub_kind = schemas.scalar_kind(sub_field)
                if sub_kind is not None:
                    yield (name, sub), sub_kind, schemas.alternatives(sub_field)[0], schemas.minimal(alt)


def with_value(body: dict[str, Any], path: tuple[str, ...], raw: str, parent: Any = None) -> str:
    """``body`` as JSON text with the field at ``path`` set to the JSON text ``raw``."""
    marker = "@@BAD@@"
    out = json.loads(json.dumps(body))
    if len(path) == 2:
        out[path[0]] = dict(parent or {})
        out[path[0]][path[1]] = marker
    else:
        out[path[0]] = marker
    return json.dumps(out).replace(f'"{marker}"', raw)


def test_strict_types_non_finite_and_huge_numbers_on_every_json_route(server, client, openapi, routes):
    schemas = Schemas(openapi)
    checked = 0
    for path, schema in routes:
        body = schemas.minimal(schema)
        for field_path, kind, _, parent in scalar_fields(schemas, schema):
            for raw in BAD_SCALARS[kind]:
                r = post_raw(client, path, with_value(body, field_path, raw, parent))
                check_4xx(server, path, r, field_path[-1])
                checked += 1
    assert checked > 300  # the enumeration found the dialects' numeric fields


def test_declared_ranges_hold_on_every_json_route(server, client, openapi, routes):
    schemas = Schemas(openapi)
    for path, schema in routes:
        body = schemas.minimal(schema)
        for field_path, kind, field, parent in scalar_fields(schemas, schema):
            outside = []
            if "maximum" in field:
                outside.append(field["maximum"] + (1 if kind == "integer" else abs(field["maximum"]) + 1))
            if "exclusiveMaximum" in field:
                outside.append(field["exclusiveMaximum"])
            if "minimum" in field:
                outside.append(field["minimum"] - (1 if kind == "integer" else abs(field["minimum"]) + 1))
            if "exclusiveMinimum" in field:
                outside.append(field["exclusiveMinimum"])
            for value in outside:
                r = post_raw(client, path, with_value(body, field_path, json.dumps(value), parent))
                check_4xx(server, path, r, field_path[-1])


def test_numbers_as_real_clients_send_them_still_work(client):
    body = {"model": MODEL, "prompt": "fine", "max_tokens": 4, "temperature": 0, "top_p": 1, "n": 1,
            "logprobs": 2, "stream": False, "seed": 7, "logit_bias": {"102": 1}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fine", r.text
    r = client.post("/generate", json={"inputs": "fine", "parameters": {"max_new_tokens": 4, "temperature": 1,
                                                                         "do_sample": False, "top_k": 5}})
    assert r.status_code == 200 and r.json()["generated_text"] == "fine", r.text


def test_server_is_idle_and_healthy_afterwards(server, client):
    server.check_idle()
    assert client.get("/health").status_code == 200
