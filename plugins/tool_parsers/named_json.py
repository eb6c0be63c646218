"""A region body for calls written as a header naming the function, then a JSON object:
``functions.NAME:0<|tool_call_argument_begin|>{...}`` (kimi_k2), ``NAME<｜tool▁sep｜>{...}``
(deepseek_v31), ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n``` `` (deepseek_v3).

``NamedJson`` follows the body protocol of ``llmserve.parsing.streaming.RegionToolParser``.
The header is everything before the first ``{`` and is read by the parser's ``name_of``
(which also may give the call its id); it is bounded, so a region that never reaches a ``{``
fails after ``MAX_HEADER`` characters instead of holding the output. The object is checked
with ``JsonScanner`` and released whole once complete (the *checked* policy of
``json_calls``); a cut-off object is kept closed into valid JSON, an end marker before it
closed is malformed. After the object, whitespace and a closing code fence are consumed.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from llmserve import JsonScanner
from llmserve import RegionToolParser

MAX_HEADER = 512  # longer than any function name and its markers; a longer header is not a call
_SPACE = re.compile(r"\s*")
HEAD, ARGS, POST = range(3)

NameOf = Callable[[str], "tuple[str, str | None] | None"]


class NamedJson:
    """Header (read by ``name_of(header) -> (name, call_id or None) | None``), JSON object,
    optional ``suffix`` (a closing fence)."""

    def __init__(self, sink: Any, name_of: NameOf, suffix: str = "") -> None:
        self.sink, self.name_of, self.suffix = sink, name_of, suffix
        self.state = HEAD
        self.head: list[str] = []
        self.head_len = 0
        self.named: tuple[str, str | None] | None = None
        self.sc = JsonScanner()
        self.raw = 0  # characters consumed
        self.committed = self.done = self.failed = False
        self.rest = 0

    def feed(self, s: str) -> int:
        i = 0
        if self.state == HEAD and not self.done:
            i = self._head(s)
        if self.state == ARGS and not self.done and i < len(s):
            n = self.sc.feed(s[i:])
            i += n
            self.raw += n
            if self.sc.done:
                self._release(self.sc.text())
                self.state = POST
            elif self.sc.error:
                self.done = self.failed = True
        if self.state == POST and not self.done and i < len(s):
            i = self._post(s, i)
        return i

    def _head(self, s: str) -> int:
        k = s.find("{")
        taken = s if k < 0 else s[:k]
        self.head.append(taken)
        self.head_len += len(taken)
        self.raw += len(taken)
        if self.head_len > MAX_HEADER:
            self.done = self.failed = True
            return len(taken)
        if k >= 0:
            self.named = self.name_of("".join(self.head))
            if self.named is None:
                self.done = self.failed = True
            else:
                self.state = ARGS
        return len(taken)

    def _post(self, s: str, i: int) -> int:
        if not self.suffix:
            self.done, self.rest = True, self.raw
            return i
        m = _SPACE.match(s, i)
        assert m is not None  # \s* always matches
        j = m.end()
        if j < len(s):
            if s.startswith(self.suffix, j):
                j += len(self.suffix)
            elif self.suffix.startswith(s[j:]):
                self.raw += j - i
                return j  # maybe the fence, cut by the end of this piece: wait for more text
            self.done = True
        self.raw += j - i
        self.rest = self.raw
        return j

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        self.done = True
        if self.state == POST:
            self.rest = self.raw
            return
        if self.state == ARGS and cut and not self.sc.error:
            self._release(self.sc.text()[:self.sc.safe] + self.sc.closer(0))
            self.rest = self.raw
            return
        self.failed = True

    def _release(self, arguments: str) -> None:
        assert self.named is not None  # ARGS comes after a name
        self.committed = True
        self.sink._call_start(*self.named)
        self.sink._call_args(arguments)


class Mark:
    """The body of a section marker: it makes no call and consumes nothing (the parser
    decides what becomes of the marker)."""

    committed = failed = False
    done = True
    rest = 0

    def feed(self, s: str) -> int:
        return 0

    def end(self, cut: bool = True) -> None:
        return None


class SectionParser(RegionToolParser):
    """Call blocks (``call_begin`` ... ``end_marker``, a ``NamedJson`` body) inside sections
    (``section_begin`` ... ``section_end``). From a section's start until its first call,
    the text is held (it may all turn out to be content); a call drops the section's markers,
    a section that ends (or an output that ends) without one releases the text verbatim."""

    section_begin = section_end = call_begin = ""
    call_name: NameOf  # reads a call's header: a staticmethod of the family's header rule
    call_suffix = ""  # what may close a call after its object (a code fence)

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._held: list[str] | None = None  # a section's text while it has no call
        self._in_section = False  # inside a section that made a call

    def _call_body(self) -> NamedJson:
        return NamedJson(self, self.call_name, suffix=self.call_suffix)

    def _new_body(self, marker: str) -> Any:
        if marker == self.call_begin:
            return self._call_body()
        if self._held is not None:  # a marker inside a section without a call yet: text so far
            self._held.append(marker)
            if marker == self.section_end:
                self._release()
        elif marker == self.section_begin and not self._in_section:
            self._held = [marker]
        elif marker == self.section_end and self._in_section:
            self._in_section = False
        else:  # a stray marker outside any section
            super()._text(marker)
        return Mark()

    def _release(self) -> None:
        held, self._held = self._held or [], None
        super()._text("".join(held))

    def _text(self, s: str) -> None:
        if self._held is not None:
            self._held.append(s)
        else:
            super()._text(s)

    def _call_start(self, name: str, call_id: str | None = None) -> None:
        if self._held is not None:
            held, self._held = self._held[1:], None  # the section has a call: its marker goes
            super()._text("".join(held))
            self._in_section = True
        super()._call_start(name, call_id)

    def _step(self, final: bool) -> bool:
        progress = super()._step(final)
        if final and not progress and self._held is not None:
            self._release()
        return progress
