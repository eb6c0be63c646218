"""The shared half of the XML-style tool parsers (qwen3_coder, glm45/glm47, minimax_m2, seed_oss).

These families write a call as tags with one parameter per tag pair, the values as bare text
(``<parameter=city>Paris</parameter>``), so the value's JSON type is not in the output: it
comes from the request's tool schema. ``typed_value`` is that one rule, for every parser:

- the parameter's schema declares ``string`` (alone or among other types), or declares no type
  at all (an unknown tool or parameter, a schema without ``type``): the value is the text as
  written;
- otherwise the text is read as JSON (``json`` only, never ``eval``; ``True``/``False`` and
  ``None`` are accepted for ``boolean`` and ``null``) and kept when it is one of the declared
  types (``integer``: a whole number, ``5.0`` gives ``5``; ``number``: a finite number;
  ``object``, ``array``, ``boolean``, ``null``);
- anything else (not JSON, another type, too deep to read, not finite) stays the string.

Types are read from ``type`` (a name or a list), the members of ``anyOf``/``oneOf``, and a
local ``$ref`` (``#/$defs/...``, ``#/definitions/...``) followed a few hops at most, so a
recursive schema costs nothing.

``XmlToolParser`` is the region parser they share: the body of a region is read whole when
the region ends (its end marker, or the end of the output), by the family's ``read_region``;
a region that does not read as complete calls is content, verbatim, markers included. So a
call cut off by ``max_tokens`` is content: nothing half-written is run. A region's text
holding the start marker again ends the region there as not a call, which keeps every
character read by at most two regions (linear time whatever the output).
"""

from __future__ import annotations

import json
import math
from abc import abstractmethod
from typing import Any, Callable

from llmserve import RegionToolParser

_MAX_REF_HOPS = 8
_NO = object()  # "not a typed value": the text stays a string


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: JSON cannot carry it back out
        raise ValueError(text)
    return value


def _reject(name: str) -> Any:
    raise ValueError(name)


def resolve(schema: Any, root: Any) -> Any:
    """``schema`` with local ``$ref``s followed (at most a few hops: refs may loop)."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        path = schema["$ref"]
        if not path.startswith("#/"):
            return None
        node = root
        for part in path[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        schema = node
    return None


def declared_types(schema: Any, root: Any = None) -> set[str]:
    """The JSON types a parameter schema allows (empty: it does not say)."""
    schema = resolve(schema, root)
    if not isinstance(schema, dict):
        return set()
    found: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list):
            for member in members:
                member = resolve(member, root)
                if isinstance(member, dict):
                    kind = member.get("type")
                    if isinstance(kind, str):
                        found.add(kind)
                    elif isinstance(kind, list):
                        found.update(k for k in kind if isinstance(k, str))
    return found


def _as_type(value: Any, types: set[str]) -> Any:
    if isinstance(value, bool):
        return value if "boolean" in types else _NO
    if isinstance(value, int):
        return value if types & {"integer", "number"} else _NO
    if isinstance(value, float):
        if "number" in types:
            return value
        return int(value) if "integer" in types and value.is_integer() else _NO
    if value is None:
        return None if "null" in types else _NO
    if isinstance(value, dict):
        return value if "object" in types else _NO
    if isinstance(value, list):
        return value if "array" in types else _NO
    return _NO


def typed_value(raw: str, schema: Any, root: Any = None) -> Any:
    """The value of one parameter written as ``raw`` text, typed by its ``schema`` (module doc)."""
    types = declared_types(schema, root)
    if not types or "string" in types:
        return raw
    text = raw.strip()
    python_words = {"True": True, "False": False, "None": None}
    if text in python_words:
        value = python_words[text]
    else:
        try:
            value = json.loads(text, parse_float=_finite, parse_constant=_reject)
        except (ValueError, RecursionError):  # not JSON, or nested past what the reader allows
            return raw
    typed = _as_type(value, types)
    return raw if typed is _NO else typed


def arguments_json(pairs: list[tuple[str, str]], parameters: Any) -> str:
    """The ``arguments`` JSON object of a call from its ``(name, text)`` parameters, typed by
    the tool's ``parameters`` schema. A name given twice keeps its last value (at its first
    place)."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    props = props if isinstance(props, dict) else {}
    values: dict[str, str] = {}
    for key, raw in pairs:
        values[key] = raw
    parts = []
    for key, raw in values.items():
        value = typed_value(raw, props.get(key), parameters)
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):
            text = json.dumps(raw, ensure_ascii=False)
        parts.append(json.dumps(key, ensure_ascii=False) + ": " + text)
    return "{" + ", ".join(parts) + "}"


Call = tuple[str, list[tuple[str, str]]]


class _Region:
    """The body of one region (``RegionToolParser``'s body protocol): keeps the text and reads
    it once, when the region ends."""

    def __init__(self, parser: "XmlToolParser", marker: str) -> None:
        self.parser, self.marker = parser, marker
        self.parts: list[str] = []
        self.tail = ""  # the last characters fed, to find a start marker split between pieces
        self.size = 0
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        if self.done:
            return 0
        window = self.tail + s
        hit = window.find(self.marker)
        if hit >= 0:  # the start marker again: this region is not a call (module doc)
            self.done = self.failed = True
            return max(0, hit - len(self.tail))
        self.parts.append(s)
        self.size += len(s)
        self.tail = window[-(len(self.marker) - 1):] if len(self.marker) > 1 else ""
        return len(s)

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        self.done = True
        calls = self.parser.read_region("".join(self.parts))
        if not calls:
            self.failed = True
            return
        for name, pairs in calls:
            self.parser._call_start(name)
            self.parser._call_args(arguments_json(pairs, self.parser.parameters(name)))
        self.committed, self.rest = True, self.size


def skip_space(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i``."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def between(text: str, i: int, opener: str, closer: str) -> tuple[str, int] | None:
    """``text[i:]`` starts with ``opener`` (after whitespace): the text up to ``closer`` and the
    index after it, or None."""
    i = skip_space(text, i)
    if not text.startswith(opener, i):
        return None
    j = text.find(closer, i + len(opener))
    if j < 0:
        return None
    return text[i + len(opener):j], j + len(closer)


def plain_name(name: str) -> str | None:
    """A function or parameter name as written (surrounding whitespace dropped), or None when
    it is empty or holds whitespace or angle brackets (prose, not a name)."""
    name = name.strip()
    if not name or any(c.isspace() or c in "<>" for c in name):
        return None
    return name


class XmlToolParser(RegionToolParser):
    """Regions read whole by ``read_region`` (module doc); subclasses set the markers."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._schemas: dict[str, Any] | None = None

    def parameters(self, name: str) -> Any:
        """The ``parameters`` schema of the request's tool ``name`` (None when unknown)."""
        if self._schemas is None:
            self._schemas = {}
            for tool in self.tools:
                function = tool.get("function") if isinstance(tool, dict) else None
                if isinstance(function, dict) and isinstance(function.get("name"), str):
                    self._schemas.setdefault(function["name"], function.get("parameters"))
        return self._schemas.get(name)

    def _new_body(self, marker: str) -> Any:
        return _Region(self, marker)

    @abstractmethod
    def read_region(self, text: str) -> list[Call] | None:
        """The calls of a whole region's text (between the markers), or None when it is not
        exactly a sequence of complete calls (whitespace around them aside)."""


def trim_newline(value: str) -> str:
    """The value without the one newline its template writes on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def read_tagged_calls(
    text: str, tags: tuple[str, str, str], name_of: Callable[[str], str | None],
    value_of: Callable[[str], str] = str,
) -> list[Call] | None:
    """One or more ``OPEN NAME>`` ... ``CLOSE`` calls, each holding ``PARAM KEY>VALUE</parameter>``
    pairs, where ``tags`` is ``(OPEN, CLOSE, PARAM)`` (``("<function=", "</function>",
    "<parameter=")`` for Qwen3-Coder); ``name_of`` reads a written name (None: not a name) and
    ``value_of`` a written value. None when the text is not exactly complete calls (whitespace
    around them aside)."""
    opener, closer, param = tags
    calls: list[Call] = []
    i = skip_space(text, 0)
    while i < len(text):
        got = between(text, i, opener, ">")
        name = name_of(got[0]) if got else None
        if got is None or name is None:
            return None
        i, pairs = got[1], []
        while True:
            i = skip_space(text, i)
            if text.startswith(closer, i):
                i += len(closer)
                break
            head = between(text, i, param, ">")
            key = name_of(head[0]) if head else None
            if head is None or key is None:
                return None
            end = text.find("</parameter>", head[1])
            if end < 0:
                return None
            pairs.append((key, value_of(text[head[1]:end])))
            i = end + len("</parameter>")
        calls.append((name, pairs))
        i = skip_space(text, i)
    return calls or None


def read_functions(text: str) -> list[Call] | None:
    """``<function=NAME><parameter=KEY>VALUE</parameter>...</function>``, one or more (the
    Qwen3-Coder and Seed-OSS body); each value loses one newline on each side."""
    return read_tagged_calls(text, ("<function=", "</function>", "<parameter="), plain_name, trim_newline)
