"""Guided decoding end to end on the real embedded SmolLM2: chat output constrained by JSON
schemas (``response_format`` json_schema and ``guided_json``), ``json_object``, ``guided_regex``
and ``guided_choice``, streamed and not, must parse and validate.

Requests go out concurrently from a thread pool so the engine batches them; decoding is greedy
so the streamed and non-streamed answers to one request must also be identical.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 96
NAME = {"type": "string", "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}}, "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "name": NAME,
        "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": r"[0-9]{5}"}},
                    "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "string_array": {"type": "object",
                     "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                                  "minItems": 1, "maxItems": 3}},
                     "required": ["fruits"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "number_bounds": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
                      "required": ["score"]},
    "integer_bounds": {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}},
                       "required": ["rating"]},
    "boolean": {"type": "object", "properties": {"is_open": {"type": "boolean"}, "city": NAME},
                "required": ["is_open", "city"]},
    "optional": {"type": "object", "properties": {"title": NAME, "subtitle": NAME, "pages": {"type": "integer"}},
                 "required": ["title"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": r"[A-Z]{3}-[0-9]{2}"}},
                "required": ["code"]},
    "max_length": {"type": "object", "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 5}},
                   "required": ["word"]},
    "object_array": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["new", "old"]}},
        "required": ["id", "tag"]}}}, "required": ["items"]},
    "nullable": {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 12}},
                 "required": ["nickname"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, NAME]}},
               "required": ["value"]},
    "const": {"type": "object", "properties": {"kind": {"const": "person"}, "name": NAME},
              "required": ["kind", "name"]},
    "top_array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "defs_ref": {"$defs": {"point": {"type": "object",
                                     "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                     "required": ["x", "y"]}},
                 "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"]},
    "no_extra": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                 "required": ["a", "b"], "additionalProperties": False},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}}, "required": ["rows"]},
    "bool_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    "mixed": {"type": "object", "properties": {"price": {"type": "number"}, "count": {"type": "integer"},
                                               "in_stock": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
              "required": ["price", "count", "in_stock", "size"]},
    "all_of": {"allOf": [{"type": "object", "properties": {"city": NAME}, "required": ["city"]},
                         {"properties": {"country": NAME}, "required": ["country"]}]},
}


def ask(client, model, prompt: str, stream: bool, **extra) -> tuple[str, str]:
    """One greedy chat request; (content, finish_reason), streamed or not."""
    args = dict(model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
                **extra)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def run_all(client, model, jobs: list[tuple[str, bool, dict]]) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return list(pool.map(lambda job: ask(client, model, job[0], job[1], **job[2]), jobs))


def prompt_for(name: str, schema: dict) -> str:
    return f"Reply with a short JSON value for a '{name}' record matching this schema: {json.dumps(schema)}"


def test_json_schemas_validate_stream_and_not(client, model):
    assert len(SCHEMAS) >= 20
    jobs, keys = [], []
    for name, schema in SCHEMAS.items():
        for via in ("response_format", "guided_json"):
            extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}
                     if via == "response_format" else {"extra_body": {"guided_json": schema}})
            for stream in (False, True):
                jobs.append((prompt_for(name, schema), stream, extra))
                keys.append((name, via, stream))
    results = dict(zip(keys, run_all(client, model, jobs)))
    failures = []
    for (name, via, stream), (text, finish) in results.items():
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} via {via} stream={stream}: {str(exc)[:200]} in {text!r}")
    assert not failures, "\n".join(failures)
    for name in SCHEMAS:  # greedy and the same constraint: every way of asking gives one answer
        assert len({results[(name, via, s)][0] for via in ("response_format", "guided_json")
                    for s in (False, True)}) == 1, name


def test_json_object_regex_and_choice_stream_and_not(client, model):
    regexes = {"date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
               "word": r"[a-z]+ (cat|dog)"}
    choices = ["Paris", "London", "Berlin", "Rome"]
    jobs, kinds = [], []
    for stream in (False, True):
        jobs.append(("Reply with a tiny JSON object: one key, ok, set to true.", stream,
                     {"response_format": {"type": "json_object"}}))
        kinds.append(("json_object", None))
        for name, pattern in regexes.items():
            jobs.append((f"Give an example {name}.", stream, {"extra_body": {"guided_regex": pattern}}))
            kinds.append(("regex", pattern))
        jobs.append(("What is the capital of France?", stream, {"extra_body": {"guided_choice": choices}}))
        kinds.append(("choice", None))
    results = run_all(client, model, jobs)
    for (kind, pattern), (text, finish) in zip(kinds, results):
        assert finish == "stop", (kind, text)
        if kind == "json_object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "regex":
            assert re.fullmatch(pattern, text), (pattern, text)
        else:
            assert text in choices
    half = len(jobs) // 2  # greedy: the streamed half repeats the non-streamed half exactly
    assert [text for text, _ in results[half:]] == [text for text, _ in results[:half]]
