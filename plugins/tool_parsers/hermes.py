"""hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro,
Qwen2.5/Qwen3 and many fine-tunes).

Several blocks are parallel calls; a block may also hold a JSON list of call objects. A
missing ``</tool_call>`` at the end of the output is accepted after complete JSON; JSON cut off
there (``{"name": "f", "arguments": {"a": 1`` and nothing more) is content: the model was cut
off and nothing should run (the other formats close such a call). ``"parameters"`` is accepted
for ``"arguments"``. A block that is not a valid call (``json_calls``' checked rules) is
content, verbatim; the other blocks stay calls (vLLM returns the whole output as content).
Text before, between and after the blocks is content (vLLM keeps only the text before the
first block).
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CallList
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout

#: What a forced call's JSON may not hold: the block's markers (the region would end there).
_MARKERS = ("<tool_call>", "</tool_call>")


class _WholeOnly:
    """A body that takes the end of the output like an end marker: what is not complete JSON
    then is not a call (``end(cut=False)``)."""

    def __init__(self, body: CallList) -> None:
        self.body = body

    def __getattr__(self, name: str) -> Any:
        return getattr(self.body, name)

    def feed(self, s: str) -> int:
        return self.body.feed(s)

    def end(self, cut: bool = True) -> None:
        self.body.end(False)


class HermesToolParser(ForcedJson, RegionToolParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    #: Forced calls as the Hermes/Qwen templates write them, one block per call:
    #: ``<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>``.
    layout = object_layout("<tool_call>\n", "\n</tool_call>", separator="\n", words=_MARKERS)

    def _new_body(self, marker: str) -> Any:
        return _WholeOnly(CallList(self, single_ok=True, checked=True))
