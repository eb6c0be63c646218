"""llama3_json (also ``llama4_json``): JSON tool calls of Llama 3.1/3.2/4 templates.

An optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` (``"arguments"``
is accepted too); parallel calls are separated by ``;``. Like current vLLM, call objects are
found anywhere in the text; unlike it, the text around them is kept as content instead of
being dropped. An object without a name, or without both ``parameters`` and ``arguments``,
is not a call and stays content. Forced calls are written as the templates write them.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CheckedCall
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout


class Llama3JsonToolParser(ForcedJson, RegionToolParser):
    start_markers = ("<|python_tag|>", "{")
    body_markers = frozenset({"{"})
    separators = ";"
    #: Forced calls as the Llama templates write them (no ``<|python_tag|>``, which they keep for
    #: built-in tools): ``{"name": "f", "parameters": {...}}``, ``; `` between parallel calls.
    layout = object_layout(key="parameters", separator="; ")

    def _new_body(self, marker: str) -> Any:
        return CheckedCall(self, arg_keys=("parameters", "arguments"))
