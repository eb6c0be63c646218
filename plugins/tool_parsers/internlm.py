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


class InternLMToolParser(RegionToolParser):
    start_markers = ("<|action_start|><|plugin|>",)
    end_marker = "<|action_end|>"

    def _new_body(self, marker: str) -> Any:
        return CheckedCall(self, arg_keys=("parameters", "arguments"), accept=self._known)
