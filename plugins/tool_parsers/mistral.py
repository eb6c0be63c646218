"""mistral: the ``[TOOL_CALLS]`` formats of Mistral models, told apart by the text after it.

- pre-v11 tokenizers: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (a single
  object is accepted too). Text after the list is content (vLLM drops it when not streaming).
  Text between the marker and the list (``[TOOL_CALLS] junk [{...}]``) is content too; the
  list after it is read as in vLLM's fallback.
- v11+: ``[TOOL_CALLS]name{...}``, one marker per call. A name with no arguments (followed by
  the end of the output or the next marker) is a call with ``{}`` when it is one of the
  request's tools (any name when the request lists none); vLLM skips such a marker.
- v13+ HF tokenizers keep the separator: ``[TOOL_CALLS]name[ARGS]{...}``; also
  ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``, whose id is used as the call id.

Calls follow the checked rules of ``json_calls``: released whole once complete and valid;
broken JSON after a marker makes that region content (vLLM returns v11 arguments
unvalidated). Ids are 9 letters and digits (Mistral chat templates reject longer ones).
``[TOOL_CALLS]`` is a special token, so the request keeps special tokens. Forced calls may take
the v11+ form or the list (see ``_NAMED``).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from llmserve import RegionToolParser
from llmserve import CallList
from llmserve import JsonScanner
from llmserve import Structure
from llmserve.plugins.tool_parsers.forced_json import JsonLayout, object_layout

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_WS = re.compile(r"\s*")
MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
#: Forced calls in either form, the model picks the one it was trained on: v11+'s
#: ``[TOOL_CALLS]name[ARGS]{...}`` per call (without ``[CALL_ID]``, which the parser does not
#: need), or the list of older models, ``[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}]``
#: (the space as v0.3's template writes it, none as Nemo's; the id optional, any 9 characters).
_NAMED = JsonLayout(MARKER + "{}" + ARGS, bare=_NAME.fullmatch)
_ID = Structure.one_of(Structure.text(""), Structure.sequence(
    Structure.text(', "id": '), Structure.json({"type": "string", "minLength": 9, "maxLength": 9})))
_LISTED = JsonLayout(object_layout().head, (_ID, "}"), separator=", ", suffix="]",
                     prefix=(MARKER, Structure.one_of(Structure.text(" ["), Structure.text("["))))


class NamedCall:
    """``name{...}``, ``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}`` (body protocol),
    released whole when the arguments object closes; a bare ``name`` (or ``name[ARGS]``) that
    ends its region is a call with ``{}`` if ``known(name)``."""

    def __init__(self, sink: Any, known: Callable[[str], bool]) -> None:
        self.sink, self.known = sink, known
        self.state = "name"  # name, id (after [CALL_ID]), gap (after the name or [ARGS]), args
        self.name = self.call_id = ""
        self.raw = 0
        self.sc: JsonScanner | None = None
        self.args_at = 0
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n and not self.done:
            if self.state == "args":
                assert self.sc is not None  # set when the arguments begin
                i += self.sc.feed(s[i:])
                if self.sc.done:
                    self._call(self.sc.text(), self.args_at + self.sc.raw)
                elif self.sc.error:
                    self.done = self.failed = True
                break
            if self.state in ("name", "id"):
                m = _NAME.match(s, i)
                if m:
                    if self.state == "name":
                        self.name += m.group()
                    else:
                        self.call_id += m.group()
                    i = m.end()
                    continue
                markers = (ARGS, CALL_ID) if self.state == "name" else (ARGS,)
                hit = next((mk for mk in markers if s.startswith(mk, i)), None)
                if hit is not None and self.name:
                    self.state = "id" if hit == CALL_ID else "gap"
                    i += len(hit)
                    continue
                if any(mk.startswith(s[i:]) for mk in markers):
                    break  # maybe a marker: wait for more text
                if self.state == "id" or not self.name:
                    self.done = self.failed = True
                    break
                self.state = "gap"
            m = _WS.match(s, i)  # gap: whitespace, then the arguments, the next marker or the end
            i = m.end() if m else i
            if i == n:
                break
            if s[i] == "{":
                self.state, self.args_at, self.sc = "args", self.raw + i, JsonScanner()
            elif s.startswith(MARKER, i):
                self._bare(self.raw + i)
            elif not MARKER.startswith(s[i:]):
                self.done = self.failed = True
            else:
                break  # maybe the next marker: wait for more text
        self.raw += i
        return i

    def _bare(self, rest: int) -> None:
        if self.known(self.name):
            self._call("{}", rest)
        else:
            self.done = self.failed = True

    def _call(self, args: str, rest: int) -> None:
        self.done, self.committed, self.rest = True, True, rest
        self.sink._call_start(self.name, self.call_id or None)
        self.sink._call_args(args)

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        if self.state == "args":
            assert self.sc is not None  # set when the arguments begin
            self.sc.end()
            if self.sc.done:  # never for an object; kept for symmetry with the scanner
                self._call(self.sc.text(), self.args_at + self.sc.raw)
            else:  # cut off inside the arguments: closed at the last valid point
                self._call(self.sc.text()[:self.sc.safe] + self.sc.closer(), self.args_at + self.sc.safe_raw)
        elif self.name and self.state != "id":
            self._bare(self.raw)
        else:
            self.done = self.failed = True


class MistralBody:
    """Picks the form from the first character after the marker and whitespace: ``[``/``{``
    the JSON list, else ``name...``; if that is no call either, the text up to the first
    ``[`` that opens a list of call objects is junk (content once a call is made)."""

    def __init__(self, sink: Any, known: Callable[[str], bool]) -> None:
        self.sink, self.known = sink, known
        self.inner: Any = None
        self.mode = ""  # list, named, junk (looking for a list), probe (a "[" being tried)
        self.skip = 0
        self.raw = 0  # consumed after the leading whitespace
        self.base = 0  # where the inner body started
        self.seen: list[str] = []  # text consumed while junk may still turn out to precede a list
        self.junk = -1  # length of the junk before the list (-1: none)
        self.committed = self.done = self.failed = False
        self.rest = 0

    # Sink of the inner bodies: junk goes out as content before the first call.
    def _call_start(self, name: str, call_id: str | None = None) -> None:
        if self.junk >= 0:
            self.sink._text("".join(self.seen)[:self.junk])
        self.junk, self.seen = -1, []
        self.sink._call_start(name, call_id)

    def _call_args(self, fragment: str) -> None:
        self.sink._call_args(fragment)

    def _text(self, text: str) -> None:
        self.sink._text(text)

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        if self.inner is None and not self.mode:
            lead = _WS.match(s)
            assert lead is not None  # \s* always matches
            i = lead.end()
            self.skip += i
            if i == n:
                return i
            self._start(s[i] in "[{", "list" if s[i] in "[{" else "named")
        while i < n and not self.done:
            if self.mode == "junk":
                j = s.find("[", i)
                if j < 0:
                    self._take(s[i:])
                    i = n
                    break
                self._take(s[i:j])
                i = j
                if s.startswith(MARKER, j):
                    self.done = self.failed = True  # the next call's marker: no list here
                    break
                if MARKER.startswith(s[j:]):
                    break  # maybe the next marker: wait for more text
                self.junk = self.raw
                self._start(True, "probe")
            k = self.inner.feed(s[i:])
            if self.mode == "probe" or (self.mode == "named" and self.inner.state != "args"):
                self._take(s[i:i + k])
            else:
                self.raw += k
                if self.mode == "named":  # v11 arguments: no list (nor junk before one) now
                    self.seen = []
            i += k
            if self.mode == "probe" and (self.inner.state in ("elem", "sep", "next") or self.inner.committed):
                self.mode = "list"  # a call object follows the "[": this is the list
            if self.inner.done:
                if self.inner.failed and self.mode == "named" and self.inner.state != "args":
                    self.mode = "junk"
                elif self.inner.failed and self.mode == "probe":
                    self.mode = "junk"
                else:
                    self._sync()
            elif k == 0:
                break
        return i

    def _start(self, is_list: bool, mode: str) -> None:
        self.base, self.mode = self.raw, mode
        self.inner = CallList(self, single_ok=mode == "list", checked=True) if is_list else NamedCall(self, self.known)

    def _take(self, text: str) -> None:
        self.seen.append(text)
        self.raw += len(text)

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        if self.inner is not None and self.mode in ("list", "named"):
            self.inner.end(cut)
            self._sync()
        else:
            self.done = self.failed = True

    def _sync(self) -> None:
        inner = self.inner
        self.committed, self.done, self.failed = inner.committed, inner.done, inner.failed
        self.rest = self.skip + self.base + inner.rest


class MistralToolParser(RegionToolParser):
    start_markers = (MARKER,)
    id_length, id_prefix = 9, ""

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        return Structure.one_of(*(form.forced(tools, name, parallel) for form in (_NAMED, _LISTED)))

    def _new_body(self, marker: str) -> Any:
        return MistralBody(self, self._known)
