"""kimi_k2: the tool calls of Kimi-K2 (Instruct, Thinking, K2.5), as its chat template writes
them (one line in the output)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_calls_section_end|>

The call's header is ``functions.NAME:IDX``; the whole header is the call's id (the template
writes a call's id back into the next prompt in that form, so the model sees its own ids).
A header without ``functions.`` or without ``:IDX`` is accepted when the name is plain.
A call block that is not a call (a bad header, broken JSON, the end marker before the object
closed) is content, verbatim; the section markers go with the calls, and a section without
any call is content, verbatim (``named_json.SectionParser``). A header seen twice in one output
gets a new id for its second call. Forced calls are one section as the template writes it.
"""

from __future__ import annotations

import re
from typing import Any

from llmserve import Structure
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, JsonLayout
from llmserve.plugins.tool_parsers.named_json import SectionParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
#: A forced call's index: the model writes its own count (K2 Thinking counts over the conversation).
_INDEX = Structure.sequence(Structure.text(":"), Structure.repeat(Structure.one_of(
    *(Structure.text(d) for d in "0123456789")), 1, 4))
_HEADER = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_\-.]+?)(?::\d+)?)\s*" + re.escape(ARGS_BEGIN) + r"\s*")


def kimi_name(header: str) -> tuple[str, str | None] | None:
    m = _HEADER.fullmatch(header)
    if m is None:
        return None
    call_id = m.group(1) if ":" in m.group(1) else None
    return m.group(2), call_id


class KimiK2ToolParser(ForcedJson, SectionParser):
    start_markers = (CALL_BEGIN, SECTION_BEGIN, SECTION_END)
    end_marker = CALL_END
    section_begin, section_end, call_begin = SECTION_BEGIN, SECTION_END, CALL_BEGIN
    call_name = staticmethod(kimi_name)
    layout = JsonLayout((CALL_BEGIN + "functions.{}", _INDEX, ARGS_BEGIN), CALL_END, prefix=SECTION_BEGIN,
                        suffix=SECTION_END, words=(SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END),
                        bare=lambda name: (kimi_name(f"functions.{name}:0{ARGS_BEGIN}") or ("",))[0] == name)

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._ids: set[str] = set()

    def _call_start(self, name: str, call_id: str | None = None) -> None:
        # A header written twice (a model that repeats its count) would give two calls one id.
        if call_id in self._ids:
            call_id = None
        elif call_id is not None:
            self._ids.add(call_id)
        super()._call_start(name, call_id)
