"""Reading forced tool-call output, and the ``parallel_tool_calls: false`` filter.

``tool_choice`` "required" or a named function makes guided decoding force the output into
JSON (``llmserve.parsing.tool_choice`` plans the schema); the parsers here read it, instead of
a ``--tool-call-parser`` plugin:

- ``required``: ``[{"name": ..., "arguments": {...}}, ...]``, read by ``json_calls.CallList``,
  the body the hermes, granite and jamba parsers use, so forced and free-text calls stream
  and close alike (``RequiredCallsParser``);
- a named function: the whole output is its arguments object (``NamedCallParser``).

``forced_parser(plan)`` picks the one a ``ToolPlan`` asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.parsing.contract import ParseDelta, ToolCallDelta, ToolParser, new_call_id
from llmserve.parsing.json_calls import CallList
from llmserve.parsing.streaming import StreamingToolParser

if TYPE_CHECKING:
    from llmserve.parsing.tool_choice import ToolPlan


def first_call_only(delta: ParseDelta) -> ParseDelta:
    """``parallel_tool_calls: false`` under ``auto``: drop pieces of every call after the first."""
    if any(c.index > 0 for c in delta.tool_calls):
        delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
    return delta


class NamedCallParser(ToolParser):
    """Forced named function: the whole output is the arguments object of one call."""

    def __init__(self, name: str) -> None:
        super().__init__(None, [])
        self.name = name
        self.started = False

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ParseDelta()
            self.started = True
            return ParseDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, text)])
        return ParseDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])

    def finish(self) -> ParseDelta:
        if self.started:
            return ParseDelta()
        self.started = True  # nothing generated (e.g. max_tokens reached at once): an empty call
        return ParseDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, "")])


class RequiredCallsParser(StreamingToolParser):
    """Forced ``required``: ``[{"name": ..., "arguments": {...}}, ...]``, streamed.

    Key order is free (arguments seen before the name wait for it) and arguments stream as
    they are generated; a list cut off by ``max_tokens`` keeps its started calls with their
    arguments closed into valid JSON. Nothing is content: the output is JSON by construction,
    so whatever is not a call (a list cut off before its first name) is dropped.
    """

    needs_special_tokens = False  # forced JSON has no marker tokens to keep

    def __init__(self) -> None:
        super().__init__(None, [])
        self._list = CallList(self, single_ok=False)

    def _step(self, final: bool) -> bool:
        if not self._list.done and self._pos < len(self._buf):
            self._pos += self._list.feed(self._buf[self._pos:])
        if final:
            self._list.end()
        return False  # one pass consumes all it can: CallList keeps its own state


def forced_parser(plan: "ToolPlan") -> ToolParser:
    """The parser for a forced plan's output (``plan.mode == "forced"``)."""
    if plan.forced_name is not None:
        return NamedCallParser(plan.forced_name)
    return RequiredCallsParser()

