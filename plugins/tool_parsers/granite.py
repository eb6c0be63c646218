"""granite: ``<|tool_call|>`` (Granite 3.0) or ``<tool_call>`` (Granite 3.1) followed by a JSON
list of ``{"name", "arguments"}`` objects, with no closing tag. Like vLLM, a list at the very
start of the output is accepted without a marker. Text after the list is content. Forced
calls are a marker and the list, ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]``.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CallList
from llmserve import Structure
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout

#: Either marker may open forced calls: the model writes the one it was trained on.
_OPEN = Structure.one_of(Structure.text("<|tool_call|>"), Structure.text("<tool_call>"))


class GraniteToolParser(ForcedJson, RegionToolParser):
    start_markers = ("<|tool_call|>", "<tool_call>")
    lead_markers = ("[",)
    body_markers = frozenset({"["})
    layout = object_layout(prefix=(_OPEN, "["), separator=", ", suffix="]")

    def _new_body(self, marker: str) -> Any:
        return CallList(self, single_ok=True, checked=True)
