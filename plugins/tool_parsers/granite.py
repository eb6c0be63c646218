"""granite: ``<|tool_call|>`` (Granite 3.0) or ``<tool_call>`` (Granite 3.1) followed by a JSON
list of ``{"name", "arguments"}`` objects, with no closing tag. Like vLLM, a list at the very
start of the output is accepted without a marker. Text after the list is content.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CallList


class GraniteToolParser(RegionToolParser):
    start_markers = ("<|tool_call|>", "<tool_call>")
    lead_markers = ("[",)
    body_markers = frozenset({"["})

    def _new_body(self, marker: str) -> Any:
        return CallList(self, single_ok=True, checked=True)
