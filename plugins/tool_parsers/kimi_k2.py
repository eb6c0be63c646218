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
any call is content, verbatim (``named_json.SectionParser``).
"""

from __future__ import annotations

import re

from llmserve.plugins.tool_parsers.named_json import SectionParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_HEADER = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_\-.]+?)(?::\d+)?)\s*" + re.escape(ARGS_BEGIN) + r"\s*")


def kimi_name(header: str) -> tuple[str, str | None] | None:
    m = _HEADER.fullmatch(header)
    if m is None:
        return None
    call_id = m.group(1) if ":" in m.group(1) else None
    return m.group(2), call_id


class KimiK2ToolParser(SectionParser):
    start_markers = (CALL_BEGIN, SECTION_BEGIN, SECTION_END)
    end_marker = CALL_END
    section_begin, section_end, call_begin = SECTION_BEGIN, SECTION_END, CALL_BEGIN
    call_name = staticmethod(kimi_name)
