"""internlm: ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>``
(InternLM 2 / 2.5).

Like current vLLM, a name that is not among the request's tools is not a call (the block
stays content); without a tools list every name is accepted. Text before and after the block
is content.
"""

from __future__ import annotations

from typing import Any

from llmserve import RegionToolParser
from llmserve import CheckedCall
from llmserve.plugins.tool_parsers.forced_json import ForcedJson, object_layout

START, END = "<|action_start|><|plugin|>", "<|action_end|>"


class InternLMToolParser(ForcedJson, RegionToolParser):
    start_markers = (START,)
    end_marker = END
    #: Forced calls as InternLM writes them, a newline after the markers, one block per call.
    layout = object_layout(START + "\n", END, key="parameters", separator="\n",
                           words=("<|action_start|>", "<|plugin|>", END))

    def _new_body(self, marker: str) -> Any:
        return CheckedCall(self, arg_keys=("parameters", "arguments"), accept=self._known)
