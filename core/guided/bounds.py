"""Bounds on output constraints: what a request may ask guided decoding to compile.

A constraint is checked before any compiling (``check_bounds``): its size in bytes, how deeply
a JSON schema nests, how many items one list or object holds (choices, enum values,
properties, alternatives of a regex group), and how large a regular expression becomes once
its counted repetitions are written out (``a{100000}``, ``(a{1000}){1000}``). These checks are
linear in the constraint and answer a 400 naming the request field. What they cannot see (a
regex whose automaton explodes) is stopped by time, on the compile worker
(``llmserve.guided.worker``).
"""

from __future__ import annotations

import json
import re._constants as sre_c
import re._parser as sre_parse
from dataclasses import dataclass
from typing import Any

from llmserve.config import GuidedConfig
from llmserve.errors import InvalidRequestError

_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT)
_GROUPS = (sre_c.ASSERT, sre_c.ASSERT_NOT)


@dataclass(slots=True, frozen=True)
class GuidedLimits:
    """The bounds every constraint is held to (``--guided-*`` flags)."""

    compile_timeout: float = 10.0  # seconds one compilation may run
    max_bytes: int = 65536         # the constraint's size; also a regex's size once written out
    max_depth: int = 64            # nesting of objects and arrays in a JSON schema; of groups in a regex
    max_items: int = 1024          # choices, enum values, properties, anyOf branches, regex alternatives
    max_pending: int = 64          # distinct constraints waiting for the compile worker (more: 503)

    @classmethod
    def from_config(cls, guided: GuidedConfig) -> "GuidedLimits":
        """The bounds the guided section sets (``max_pending`` is the server's own)."""
        return cls(compile_timeout=guided.guided_compile_timeout, max_bytes=guided.guided_max_bytes,
                   max_depth=guided.guided_max_depth, max_items=guided.guided_max_items)


# -- static checks -------------------------------------------------------------------------------
def check_bounds(kind: str, value: Any, param: str | None, limits: GuidedLimits) -> None:
    """Refuse (400 naming ``param``) a constraint past ``limits``; linear in its size."""
    label = param or kind
    if kind in ("regex", "grammar"):
        _check_size(len(value.encode("utf-8", "surrogatepass")), label, param, limits)
        if kind == "regex":
            check_regex(value, label, param, limits)
    elif kind == "choice":
        if len(value) > limits.max_items:
            raise InvalidRequestError(f"{label}: at most {limits.max_items} choices are allowed, got {len(value)}",
                                      param=param)
        _check_size(sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in value), label, param, limits)
    elif kind == "json_schema":
        patterns = _check_tree(value, label, param, limits)
        _check_size(len(json.dumps(value, ensure_ascii=False)), label, param, limits)
        for path, pattern in patterns:
            check_regex(pattern, f"{label}: the regex pattern at {path}", param, limits)
    elif kind == "structure":  # its shape and size, then each JSON schema in it as above
        from llmserve.guided.structure import check_structure

        for schema in check_structure(value, param, limits):
            for path, pattern in _check_tree(schema, label, param, limits):
                check_regex(pattern, f"{label}: the regex pattern at {path}", param, limits)


def _check_size(size: int, label: str, param: str | None, limits: GuidedLimits) -> None:
    if size > limits.max_bytes:
        raise InvalidRequestError(f"{label}: the constraint is too large ({size} bytes; at most "
                                  f"{limits.max_bytes})", param=param)


def _check_tree(value: Any, label: str, param: str | None, limits: GuidedLimits) -> list[tuple[str, str]]:
    """Depth and width of a JSON value, walked without recursion; returns its string
    ``pattern`` keywords (and ``patternProperties`` keys) with their paths."""
    patterns: list[tuple[str, str]] = []
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        where = path or "/"
        if depth > limits.max_depth:
            raise InvalidRequestError(f"{label}: the schema nests too deeply (more than {limits.max_depth} levels "
                                      f"of objects and arrays, at {where})", param=param)
        if len(node) > limits.max_items:
            raise InvalidRequestError(f"{label}: too many items at {where} ({len(node)}; at most "
                                      f"{limits.max_items})", param=param)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            child_path = f"{path}/{key}"
            if key == "pattern" and isinstance(child, str):
                patterns.append((child_path, child))
            elif key == "patternProperties" and isinstance(child, dict):
                patterns.extend((f"{child_path}/{k}", k) for k in child)
            stack.append((child, child_path, depth + 1))
    return patterns


def check_regex(pattern: str, label: str, param: str | None, limits: GuidedLimits) -> None:
    """Syntax (Python's), group nesting, alternatives per group, and the size the pattern takes
    once its counted repetitions are written out."""
    bars = _alternatives(pattern)
    if bars > limits.max_items:  # before parsing: Python's parser is slow on a wide alternation
        raise InvalidRequestError(f"{label}: the regular expression has {bars} alternatives (at most "
                                  f"{limits.max_items})", param=param)
    try:
        tree = sre_parse.parse(pattern)
    except RecursionError:
        raise InvalidRequestError(f"{label}: the regular expression nests too deeply", param=param) from None
    except (sre_c.error, OverflowError, ValueError) as exc:
        raise InvalidRequestError(f"{label}: invalid regular expression: {exc}", param=param) from None
    size = _regex_size(tree, 1, label, param, limits)
    if size > limits.max_bytes:
        raise InvalidRequestError(
            f"{label}: the regular expression is too large once its repetitions are written out (more than "
            f"{limits.max_bytes} characters; a{{100000}} or (a{{1000}}){{1000}} are past it)", param=param)


def _alternatives(pattern: str) -> int:
    """How many ``|`` the pattern has outside character classes (escapes skipped)."""
    count, i, in_class = 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":  # a leading ] is a member
                i += 1
        elif c == "|":
            count += 1
        i += 1
    return count


def _regex_size(items: Any, depth: int, label: str, param: str | None, limits: GuidedLimits) -> int:
    if depth > limits.max_depth:
        raise InvalidRequestError(f"{label}: the regular expression nests more than {limits.max_depth} groups deep",
                                  param=param)
    cap = limits.max_bytes + 1  # sizes are clamped here, so products never grow large
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av
            times = max(low, 1) + 1 if high == sre_c.MAXREPEAT else high
            size = _regex_size(sub, depth + 1, label, param, limits) * max(times, 1)
        elif op is sre_c.SUBPATTERN:
            size = _regex_size(av[3], depth + 1, label, param, limits)
        elif op is sre_c.BRANCH:
            if len(av[1]) > limits.max_items:
                raise InvalidRequestError(f"{label}: a group of the regular expression has {len(av[1])} "
                                          f"alternatives (at most {limits.max_items})", param=param)
            size = sum(_regex_size(b, depth + 1, label, param, limits) for b in av[1])
        elif op in _GROUPS:
            size = _regex_size(av[1], depth + 1, label, param, limits)
        elif op is sre_c.ATOMIC_GROUP:
            size = _regex_size(av, depth + 1, label, param, limits)
        elif op is sre_c.GROUPREF_EXISTS:
            size = sum(_regex_size(b, depth + 1, label, param, limits) for b in av[1:] if b is not None)
        elif op is sre_c.IN:
            size = max(1, len(av) // 8)  # a class is one character; a very long one still costs its text
        else:
            size = 1
        total = min(cap, total + min(cap, size))
    return total
