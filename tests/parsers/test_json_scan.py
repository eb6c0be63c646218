"""The incremental JSON scanner: every prefix of a valid document stays closable into valid
JSON that agrees with what was sent, and invalid input stops exactly at the bad character."""

from __future__ import annotations

import json
import random

import pytest

from llmserve.parsing.json_scan import JsonScanner


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "lit"] + (["obj", "arr"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t{}[]:,é你👋\x01') for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -2.25e-7, 1e21, 3.0])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "obj":
        return {f"k{i}{rng.choice(['', 'é', ' '])}": random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def documents():
    rng = random.Random(7)
    docs = ['{}', '[]', '{"a": [1, 2.5e-3, -0, true, false, null, "x\\"y\\\\z\\u00e9"]}', ' { "a" : { } } ']
    for _ in range(60):
        value = {"root": random_value(rng)}
        docs.append(json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])))
    return docs


@pytest.mark.parametrize("doc", documents())
def test_every_prefix_closes_into_valid_json(doc):
    for k in range(len(doc) + 1):
        sc = JsonScanner()
        assert sc.feed(doc[:k]) == min(k, len(doc.rstrip())) and not sc.error, doc[:k]
        sent = sc.text()[:sc.safe]
        assert doc.startswith(sent)  # no control characters in json.dumps output: sent is raw text
        if sc.safe:
            json.loads(sent + sc.closer())
    sc = JsonScanner()
    sc.feed(doc.strip())
    assert sc.done and sc.text() == doc.strip() and sc.safe == len(doc.strip())


def test_safe_point_only_moves_forward_and_piecewise_feeding_agrees():
    doc = '{"a": [1, {"b": "c\\nd"}], "e": -12.5e+3, "f": "x"}'
    sc, last = JsonScanner(), 0
    for ch in doc:
        sc.feed(ch)
        assert sc.safe >= last
        last = sc.safe
    assert sc.done and sc.text() == doc


@pytest.mark.parametrize("text,stop", [
    ('{"a": tru}', 9), ('{"a": 1,}', 8), ('{"a" 1}', 5), ('[1 2]', 3), ('{"a": 01}', 7), ('{"a": "\\x"}', 8),
    ('{"a": -}', 7), ('{a: 1}', 1), ('{"a": 1.}', 8), ('{"a": [}', 7), ('{"a": NaN}', 6),
])
def test_invalid_input_stops_at_the_bad_character(text, stop):
    sc = JsonScanner()
    assert sc.feed(text) == stop and sc.error


@pytest.mark.parametrize("prefix,closed", [
    ('{"a": "Par', '{"a": "Par"}'), ('{"a": 1, "b', '{"a": 1}'), ('{"a": tr', '{}'),
    ('{"a": [1, {"b": ', '{"a": [1, {}]}'),
    ('{"a": "x\\', '{"a": "x"}'), ('{"a": "\\u00', '{"a": ""}'), ('{"a": 12', '{"a": 12}'), ('{"a": 1.', '{"a": 1}'),
    ('{"a": [1,', '{"a": [1]}'),
])
def test_truncated_prefixes_close_at_the_last_safe_point(prefix, closed):
    sc = JsonScanner()
    sc.feed(prefix)
    assert sc.text()[:sc.safe] + sc.closer() == closed


def test_raw_control_characters_in_strings_are_escaped():
    sc = JsonScanner()
    sc.feed('{"code": "a\nb\tc\x01"}')
    assert sc.done and sc.text() == '{"code": "a\\nb\\tc\\u0001"}'
    assert json.loads(sc.text()) == {"code": "a\nb\tc\x01"}


def test_top_level_number_needs_the_end():
    sc = JsonScanner()
    sc.feed("12")
    assert not sc.done
    sc.end()
    assert sc.done and sc.text() == "12"


def test_watch_depth_events():
    sc = JsonScanner(watch_depth=1)
    sc.feed('{"name": "f", "arguments": {"x": [1]}, "n": 2}')
    assert [e for e in sc.events if e[0] == "key"] == [("key", "name"), ("key", "arguments"), ("key", "n")]
    starts = [p for kind, p in sc.events if kind == "vstart"]
    ends = [p for kind, p in sc.events if kind == "vend"]
    values = [sc.text()[a:b] for a, b in zip(starts, ends)]
    assert values == ['"f"', '{"x": [1]}', "2"]
