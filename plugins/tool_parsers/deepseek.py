"""deepseek_v3 and deepseek_v31: the tool calls of DeepSeek-V3 and of DeepSeek-V3.1/V3.2.

Both wrap the calls in ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` and each call in
``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>`` (full-width bars, ``▁`` for spaces, as in
the models' chat templates). Inside a call, V3 writes the type, ``<｜tool▁sep｜>``, the name
and the arguments in a fenced block::

    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>

and V3.1/V3.2 the name, ``<｜tool▁sep｜>`` and the bare object:
``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.

Each call block is a region (``named_json.NamedJson``): a block that is not a call is
content, verbatim, its own markers included. The section markers go with the calls; a section
without any call is content, verbatim (``named_json.SectionParser``). Text around the calls
is content, as for every built-in parser. Forced calls are one section, written as the
templates write it.
"""

from __future__ import annotations

import re

from llmserve.plugins.tool_parsers.forced_json import ForcedJson, JsonLayout
from llmserve.plugins.tool_parsers.named_json import SectionParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_NAME = re.compile(r"[^\s<>{}]+")
_FENCE = re.compile(r"\s*```(?:json)?\s*$")


def _name(text: str) -> str | None:
    text = text.strip()
    return text if _NAME.fullmatch(text) else None


def v3_name(header: str) -> tuple[str, str | None] | None:
    """``function<｜tool▁sep｜>NAME`` then the opening fence."""
    kind, sep, rest = header.partition(SEP)
    fence = _FENCE.search(rest)
    name = _name(rest[:fence.start()] if fence else rest)
    return (name, None) if sep and kind.strip() == "function" and name else None


def v31_name(header: str) -> tuple[str, str | None] | None:
    """``NAME<｜tool▁sep｜>`` (only whitespace after the separator)."""
    head, sep, rest = header.partition(SEP)
    name = _name(head)
    return (name, None) if sep and not rest.strip() and name else None


class DeepSeekV31ToolParser(ForcedJson, SectionParser):
    start_markers = (CALL_BEGIN, CALLS_BEGIN, CALLS_END)
    end_marker = CALL_END
    section_begin, section_end, call_begin = CALLS_BEGIN, CALLS_END, CALL_BEGIN
    call_name = staticmethod(v31_name)
    layout = JsonLayout(CALL_BEGIN + "{}" + SEP, CALL_END, prefix=CALLS_BEGIN, suffix=CALLS_END, words=_MARKERS,
                        bare=lambda name: v31_name(name + SEP) == (name, None))


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    call_name = staticmethod(v3_name)
    call_suffix = "```"
    #: The template puts a newline between two calls.
    layout = JsonLayout(CALL_BEGIN + "function" + SEP + "{}\n```json\n", "\n```" + CALL_END, prefix=CALLS_BEGIN,
                        separator="\n", suffix=CALLS_END, words=_MARKERS,
                        bare=lambda name: v3_name(f"function{SEP}{name}\n```json\n") == (name, None))
