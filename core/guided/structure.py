"""Structured constraints: an output described piece by piece (``GuidedSpec`` kind ``"structure"``).

A tool-call parser that knows how its family writes calls describes that syntax with these
pieces, so that a forced call (``tool_choice`` ``required`` or a named function) is generated in
the family's own format (``ToolParser.forced_calls``); any plugin may build one. A structure is
plain JSON (dicts and lists), so it caches and compares like every other constraint; build it
with ``Structure``:

- ``Structure.text(s)``: exactly ``s``. A decoder writes the parts of ``s`` that are the text of
  one of the tokenizer's special tokens (``<|channel|>``) as that token, never spelled out;
- ``Structure.json(schema, without=())``: one compact JSON value valid under ``schema``;
- ``Structure.free_text(without, min_length=0, max_length=None)``: any text that contains none
  of the strings ``without`` (a closing tag), ``min_length`` to ``max_length`` characters;
- ``Structure.sequence(*parts)``, ``Structure.one_of(*options)``;
- ``Structure.repeat(part, min_times, max_times, separator=None)``: ``part`` ``min_times`` to
  ``max_times`` times, ``separator`` between two.

``json`` and ``free_text`` take ``without``: strings their text may not contain (a free-text
value may not hold the closing tag that ends it, nor a JSON string a marker the family's parser
would stop at). ``check_structure`` checks a structure's shape and holds it to the
``--guided-*`` bounds in time linear in its size.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from llmserve.errors import InvalidRequestError

#: Most strings one ``without`` list may hold, and the longest of them.
MAX_WITHOUT, MAX_WITHOUT_LEN = 16, 64
_KEYS = ("text", "json", "free_text", "sequence", "one_of", "repeat")


class Structure:
    """Builders of structure pieces (see the module doc); each returns a plain dict."""

    @staticmethod
    def text(value: str) -> dict[str, Any]:
        return {"text": value}

    @staticmethod
    def json(schema: dict[str, Any], without: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
        return {"json": schema, "without": list(without)} if without else {"json": schema}

    @staticmethod
    def free_text(without: tuple[str, ...] | list[str], min_length: int = 0,
                  max_length: int | None = None) -> dict[str, Any]:
        return {"free_text": {"without": list(without), "min_length": min_length, "max_length": max_length}}

    @staticmethod
    def sequence(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"sequence": list(parts)}

    @staticmethod
    def one_of(*options: dict[str, Any]) -> dict[str, Any]:
        return {"one_of": list(options)}

    @staticmethod
    def repeat(part: dict[str, Any], min_times: int, max_times: int,
               separator: dict[str, Any] | None = None) -> dict[str, Any]:
        node: dict[str, Any] = {"repeat": part, "min": min_times, "max": max_times}
        if separator is not None:
            node["separator"] = separator
        return node


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _without(value: Any, bad: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_WITHOUT or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_WITHOUT_LEN for s in value):
        raise bad(f"'without' must be a list of at most {MAX_WITHOUT} non-empty strings of at most "
                  f"{MAX_WITHOUT_LEN} characters")


def check_structure(value: Any, param: str | None, limits: Any) -> list[dict[str, Any]]:
    """Check a structure's shape and bounds without recursion (400 naming ``param``); returns its
    JSON schemas, for the schema bounds. Nesting counts towards ``max_depth``, list lengths and
    repetitions towards ``max_items``, the whole as JSON towards ``max_bytes``."""
    label = param or "structure"

    def bad(message: str, path: str = "") -> InvalidRequestError:
        return InvalidRequestError(f"{label}: {message}{f' (at {path})' if path else ''}", param=param)

    schemas: list[dict[str, Any]] = []
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > limits.max_depth:
            raise bad(f"the structure nests more than {limits.max_depth} levels deep", path)
        keys = [k for k in _KEYS if isinstance(node, dict) and k in node]
        if len(keys) != 1:
            raise bad(f"each piece must be an object with exactly one of {', '.join(_KEYS)}", path or "/")
        key = keys[0]
        body, where = node[key], f"{path}/{key}"
        if key == "text":
            if not isinstance(body, str):
                raise bad("text must be a string", where)
        elif key == "json":
            if not isinstance(body, dict):
                raise bad("json must be a JSON schema object", where)
            _without(node.get("without", []), partial(bad, path=where))
            schemas.append(body)
        elif key == "free_text":
            _free_text(body, limits, partial(bad, path=where))
        elif key in ("sequence", "one_of"):
            if not isinstance(body, list) or (key == "one_of" and not body):
                raise bad(f"{key} must be a {'non-empty ' if key == 'one_of' else ''}list of pieces", where)
            if len(body) > limits.max_items:
                raise bad(f"too many pieces ({len(body)}; at most {limits.max_items})", where)
            stack.extend((part, f"{where}/{i}", depth + 1) for i, part in enumerate(body))
        else:
            low, high = node.get("min"), node.get("max")
            if not (_int(low) and _int(high) and 0 <= low <= high and 1 <= high <= limits.max_items):
                raise bad(f"repeat needs whole numbers 0 <= min <= max, 1 <= max <= {limits.max_items}", where)
            stack.append((body, where, depth + 1))
            if node.get("separator") is not None:
                stack.append((node["separator"], f"{path}/separator", depth + 1))
    size = len(json.dumps(value, ensure_ascii=False))
    if size > limits.max_bytes:
        raise bad(f"the constraint is too large ({size} bytes; at most {limits.max_bytes})")
    return schemas


def _free_text(body: Any, limits: Any, bad: Any) -> None:
    if not isinstance(body, dict):
        raise bad("free_text must be an object")
    _without(body.get("without", []), bad)
    low, high = body.get("min_length", 0), body.get("max_length")
    if not _int(low) or low < 0 or (high is not None and (not _int(high) or high < max(low, 1))):
        raise bad("free_text needs whole numbers 0 <= min_length <= max_length (max_length >= 1 or null)")
    if max(low, high or 0) > limits.max_bytes:
        raise bad(f"free_text lengths may be at most {limits.max_bytes}")
