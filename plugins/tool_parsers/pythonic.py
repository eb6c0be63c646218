"""pythonic: a Python list of calls, ``[get_weather(city='Paris', days=3), now()]`` (Llama 3.2,
ToolACE, Gemma 3 templates).

The output must start with ``[`` (leading whitespace allowed); otherwise it is all content.
Arguments are keyword arguments with literal values (str, int, float, bool, None, and lists,
tuples and dicts of those); they become a JSON object in source order (``None`` -> ``null``).
Each call is sent whole (name and arguments) when its element ends, at ``,`` or ``]``.

Invalid elements (positional or non-literal arguments, ``1e999``, bytes, a syntax error) are
skipped: their text becomes content and their valid siblings stay calls, wherever they are in
the list (as in recent vLLM). A list without any valid call is content as a whole (it was
prose that starts with ``[``). Text after the closing ``]`` is content (vLLM rejects the
output).
A cut-off output keeps the complete calls; the unfinished element is dropped (if no call was
complete, the whole output is content).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from llmserve import RegionToolParser


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError("unsupported key")
            out[key] = _jsonable(v)
        return out
    raise ValueError(f"unsupported literal {type(value).__name__}")


def parse_call(source: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` for one ``name(kw=literal, ...)``, or None if it is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            args[kw.arg] = _jsonable(ast.literal_eval(kw.value))
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicList:
    """``[call, call, ...]`` (body protocol of ``base.RegionToolParser``)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.state = "open"
        self.raw = 0
        self.unit = 0
        self.parts: list[str] = []
        self.depth: list[str] = []
        self.quote = ""
        self.esc = False
        self.lead = ""
        self.skipped: list[str] = []  # elements that are not calls, held until the list has one
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n and not self.done:
            c = s[i]
            if self.state == "elem":
                k, stop = self._scan(s, i)
                self.parts.append(s[i:k])
                self.raw += k - i
                i = k
                if stop is None:
                    break
                self._element("".join(self.parts))
                self.state, self.lead = "next" if stop == "," else "closed", ""
                if stop == "]":
                    self.done, self.rest, self.failed = True, self.raw + 1, not self.committed
            elif self.state == "open":
                if c != "[":
                    self.done = self.failed = True
                    break
                self.state = "first"
            elif c.isspace():
                self.lead += c
            elif c == "]":  # a list without calls (even ``[]``) stays text
                self.state, self.done, self.rest, self.failed = "closed", True, self.raw + 1, not self.committed
            elif c == ",":
                self._stop()
                break
            else:
                self.state, self.unit, self.parts = "elem", self.raw, [self.lead]
                self.lead = ""
                continue
            i += 1
            self.raw += 1
        return i

    def _scan(self, s: str, i: int) -> tuple[int, str | None]:
        """Advance through an element; stop at a top-level ``,``/``]`` (returned) or the end."""
        n = len(s)
        while i < n:
            c = s[i]
            q = self.quote
            if q:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif len(q) == 3:
                    if s.startswith(q, i):
                        self.quote = ""
                        i += 3
                        continue
                    if c == q[0] and q.startswith(s[i:]):
                        return i, None  # maybe the closing quotes: wait
                elif c == q or c == "\n":
                    self.quote = ""
                i += 1
                continue
            if c in "'\"":
                if n - i < 3 and s[i:] == c * (n - i):
                    return i, None  # maybe a triple quote: wait
                self.quote = c * 3 if s.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in "([{":
                self.depth.append(c)
            elif c in ")]}" and self.depth:
                self.depth.pop()
            elif (c == "," or c == "]") and not self.depth:
                return i, c
            i += 1
        return i, None

    def _element(self, source: str) -> None:
        call = parse_call(source)
        if call is None:
            self.skipped.append(source)  # not a call: content, released once the list has a call
        else:
            self.committed = True
            self._release_skipped()
            self.sink._call_start(call[0])
            self.sink._call_args(call[1])
        if self.committed:
            self._release_skipped()

    def _release_skipped(self) -> None:
        for source in self.skipped:
            self.sink._text(source)
        self.skipped = []

    def _stop(self) -> None:
        self.done, self.rest = True, self.raw
        self.failed = not self.committed

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        if self.state == "elem" and not self.quote and not self.depth:
            call = parse_call("".join(self.parts))
            if call is not None:
                self._element("".join(self.parts))
                self.done, self.rest = True, self.raw
                return
        if self.state == "elem":
            self.raw = self.unit
        self._stop()


class PythonicToolParser(RegionToolParser):
    needs_special_tokens = False
    lead_markers = ("[",)
    body_markers = frozenset({"["})

    def _new_body(self, marker: str) -> Any:
        return PythonicList(self)
