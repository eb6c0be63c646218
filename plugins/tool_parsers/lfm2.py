"""lfm2: Liquid LFM2 / LFM2.5 tool calls, ``<|tool_call_start|>[name(k="v"), ...]<|tool_call_end|>``.

Inside the markers is a Python list of calls, read by the pythonic parser's body
(``pythonic.PythonicList``, with its rules: literal keyword arguments only, an element that
is not a call is content while its valid siblings stay calls, a list without a call is
content with its markers). Whitespace between the start marker and the list is allowed.
Several marked lists are parallel calls; text around them is content.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve.plugins.tool_parsers.pythonic import PythonicList


class SpacedList:
    """``PythonicList`` after optional whitespace (same body protocol)."""

    def __init__(self, sink: Any) -> None:
        self.inner = PythonicList(sink)
        self.lead = 0
        self.started = False

    def __getattr__(self, name: str) -> Any:  # done, failed, committed: the list's own
        return getattr(self.inner, name)

    @property
    def rest(self) -> int:
        return self.lead + self.inner.rest

    def feed(self, s: str) -> int:
        i = 0
        if not self.started:
            i = len(s) - len(s.lstrip())
            self.lead += i
            if i == len(s):
                return i
            self.started = True
        return i + self.inner.feed(s[i:])

    def end(self, cut: bool = True) -> None:
        self.inner.end(cut)


class Lfm2ToolParser(RegionToolParser):
    start_markers = ("<|tool_call_start|>",)
    end_marker = "<|tool_call_end|>"

    def _new_body(self, marker: str) -> Any:
        return SpacedList(self)
