"""Parsed model output as OpenAI chat-chunk ``delta`` objects.

The parse chain (``llmserve.parsing.chain``) releases dialect-neutral ``ParseDelta``s; this is
the OpenAI rendering of one, so the core knows nothing of the wire shape.
"""

from __future__ import annotations

from typing import Any

from llmserve import ParseDelta


#: Where the thinking goes: vLLM's current field, then the older name its clients still read.
REASONING_KEYS = ("reasoning", "reasoning_content")


def openai_delta(delta: ParseDelta, reasoning_keys: tuple[str, ...] = REASONING_KEYS) -> dict[str, Any] | None:
    """A ``ParseDelta`` as the ``delta`` object of an OpenAI chat chunk; ``None`` when empty.

    Reasoning text appears under each of ``reasoning_keys`` (the same text twice by default).

    A call's first piece becomes ``{"index", "id", "type": "function", "function": {"name",
    "arguments"}}``, later pieces ``{"index", "function": {"arguments"}}``.
    """
    if delta.is_empty():
        return None
    out: dict[str, Any] = {}
    if delta.reasoning:
        for key in reasoning_keys:
            out[key] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for c in delta.tool_calls:
            if c.name is not None:
                calls.append({"index": c.index, "id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
            else:
                calls.append({"index": c.index, "function": {"arguments": c.arguments}})
        out["tool_calls"] = calls
    return out
