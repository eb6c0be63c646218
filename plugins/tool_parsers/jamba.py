"""jamba: ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`` (AI21 Jamba 1.5).

Text before and after the block is content; whitespace-only text next to it is dropped.
Forced calls are one such block.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CallList
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout


class JambaToolParser(ForcedJson, RegionToolParser):
    start_markers = ("<tool_calls>",)
    end_marker = "</tool_calls>"
    layout = object_layout(prefix="<tool_calls>[", separator=", ", suffix="]</tool_calls>",
                           words=("<tool_calls>", "</tool_calls>"))

    def _new_body(self, marker: str) -> Any:
        return CallList(self, single_ok=True, checked=True)
