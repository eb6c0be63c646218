"""mistral: the ``[TOOL_CALLS]`` formats of Mistral models, told apart by the text after it.

- pre-v11 tokenizers: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (a single
  object is accepted too). Text after the list is content (vLLM drops it when not streaming).
- v11+: ``[TOOL_CALLS]name{...}``, one marker per call.
- v13+ HF tokenizers keep the separator: ``[TOOL_CALLS]name[ARGS]{...}``; also
  ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``, whose id is used as the call id.

Ids are 9 letters and digits (Mistral chat templates reject longer ones). Arguments are
validated as they stream: a cut-off or broken object is closed so it stays valid JSON (vLLM
returns v11 arguments unvalidated). ``[TOOL_CALLS]`` is a special token, so the request keeps
special tokens.
"""

from __future__ import annotations

import re
from typing import Any

from llmserve.parsing.streaming import RegionToolParser
from llmserve.parsing.json_calls import CallList
from llmserve.parsing.json_scan import JsonScanner

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_WS = re.compile(r"\s*")
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"


class NamedCall:
    """``name{...}``, ``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}`` (body protocol)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.state = "name"
        self.name = self.call_id = ""
        self.raw = 0
        self.sc: JsonScanner | None = None
        self.args_at = 0
        self.sent = 0
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n and not self.done:
            if self.state == "args":
                k = self.sc.feed(s[i:])
                i += k
                self._stream()
                if self.sc.done:
                    self.done, self.rest = True, self.args_at + self.sc.raw
                elif self.sc.error:
                    self._close()
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
            rest = s[i:]
            markers = (ARGS, CALL_ID) if self.state == "name" else (ARGS,) if self.state == "id" else ()
            hit = next((mk for mk in markers if rest.startswith(mk)), None)
            if hit is not None and (self.name or self.state != "name"):
                self.state = "id" if hit == CALL_ID else "brace"
                i += len(hit)
                continue
            if any(mk.startswith(rest) for mk in markers):
                break  # maybe a marker: wait for more text
            if rest[0] == "{" and self.state in ("name", "brace") and self.name:
                self.state, self.args_at = "args", self.raw + i
                self.sc = JsonScanner()
                self.committed = True
                self.sink._call_start(self.name, self.call_id or None)
                continue
            self.done = self.failed = True
        self.raw += i
        return i

    def _stream(self) -> None:
        end = self.sc.safe
        if end > self.sent:
            self.sink._call_args(self.sc.text()[self.sent:end])
            self.sent = end

    def _close(self) -> None:
        self._stream()
        self.sink._call_args(self.sc.closer())
        self.done, self.rest = True, self.args_at + self.sc.safe_raw

    def end(self) -> None:
        if self.done:
            return
        if self.state != "args":
            self.done = self.failed = True
            return
        self.sc.end()
        if self.sc.done:
            self._stream()
            self.done, self.rest = True, self.args_at + self.sc.raw
        else:
            self._close()


class MistralBody:
    """Picks the form from the first character after the marker and whitespace."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.inner: Any = None
        self.skip = 0
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        i = 0
        if self.inner is None:
            i = _WS.match(s).end()
            self.skip += i
            if i == len(s):
                return i
            self.inner = CallList(self.sink, single_ok=True) if s[i] in "[{" else NamedCall(self.sink)
        i += self.inner.feed(s[i:])
        self._sync()
        return i

    def end(self) -> None:
        if self.inner is None:
            self.done = self.failed = True
            return
        self.inner.end()
        self._sync()

    def _sync(self) -> None:
        inner = self.inner
        self.committed, self.done, self.failed = inner.committed, inner.done, inner.failed
        self.rest = self.skip + inner.rest


class MistralToolParser(RegionToolParser):
    start_markers = ("[TOOL_CALLS]",)
    id_length, id_prefix = 9, ""

    def _new_body(self, marker: str) -> Any:
        return MistralBody(self)
