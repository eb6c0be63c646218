"""phi4_mini_json: Phi-4-mini's tool calls, ``functools[{"name": ..., "arguments": {...}}, ...]``.

``functools`` followed by a JSON list of call objects (``"parameters"`` works for
``"arguments"``), with the *checked* list rules of ``json_calls``: an element that is not a
call is content and its valid siblings stay calls; a list without any call is content,
``functools`` included (the word in prose is not a call). Plain text markers: special tokens
are not needed. Forced calls are one such list.
"""

from __future__ import annotations

from typing import Any

from llmserve import CallList
from llmserve import RegionToolParser
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout


class Phi4MiniJsonToolParser(ForcedJson, RegionToolParser):
    needs_special_tokens = False
    start_markers = ("functools",)
    layout = object_layout(prefix="functools[", separator=", ", suffix="]")

    def _new_body(self, marker: str) -> Any:
        return CallList(self, single_ok=False, checked=True)
