"""hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro,
Qwen2.5/Qwen3 and many fine-tunes).

Several blocks are parallel calls; a block may also hold a JSON list of call objects. A
missing ``</tool_call>`` at the end of the output is accepted. ``"parameters"`` is accepted
for ``"arguments"``. A block that is not a valid call (``json_calls``' checked rules) is
content, verbatim; the other blocks stay calls (vLLM returns the whole output as content).
Text before, between and after the blocks is content (vLLM keeps only the text before the
first block).
"""

from __future__ import annotations

from typing import Any

from llmserve.parsing.streaming import RegionToolParser
from llmserve.parsing.json_calls import CallList


class HermesToolParser(RegionToolParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def _new_body(self, marker: str) -> Any:
        return CallList(self, single_ok=True, checked=True)
