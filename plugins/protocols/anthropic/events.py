"""Anthropic's streamed events, built from the parse chain's ``ParseDelta``s.

A reply is a sequence of content blocks (thinking, text, tool_use), each opened by
``content_block_start``, grown by ``content_block_delta`` and closed by
``content_block_stop``; one block is open at a time, and a block of another kind (or a new tool
call) closes the open one. A thinking block gets its ``signature_delta`` just before it closes,
as Anthropic sends it. ``Blocks`` also keeps the finished blocks, so the non-streamed reply is
the same fold of the same deltas.
"""

from __future__ import annotations

from typing import Any

from llmserve import ParseDelta
from llmserve import sse

from .params import signature, tool_input, tool_use_id

#: The keep-alive frame of this dialect (the SDK skips ``ping`` events).
PING_EVENT = sse({"type": "ping"}, "ping")


def event(kind: str, **fields: Any) -> str:
    """One SSE frame: ``event: <kind>`` and ``{"type": <kind>, ...}``."""
    return sse({"type": kind, **fields}, kind)


class Blocks:
    """The content blocks of one reply, as streamed events and as the final ``content`` list.

    ``omit_thinking`` (``thinking.display: "omitted"``) sends thinking blocks with empty text
    and the signature only.
    """

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # kind of the open block (its index is len(content) - 1)
        self._thought = ""              # the open thinking block's text, for its signature
        self._args = ""                 # the open tool_use block's arguments, for its input
        self._calls: dict[int, int] = {}  # parse-chain call index -> block index

    def add(self, delta: ParseDelta) -> list[str]:
        """The events for ``delta``: reasoning, then content, then tool-call pieces."""
        out: list[str] = []
        if delta.reasoning:
            out += self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thought += delta.reasoning
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._open_block("text", {"type": "text", "text": ""})
            self.content[-1]["text"] += delta.content
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for piece in delta.tool_calls:
            if piece.index not in self._calls:
                out += self._open_block("tool_use", {"type": "tool_use", "id": tool_use_id(piece.id or ""),
                                                     "name": piece.name or "", "input": {}}, force=True)
                self._calls[piece.index] = len(self.content) - 1
            if piece.arguments:
                index = self._calls[piece.index]
                if index == len(self.content) - 1:
                    self._args += piece.arguments
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}, index))
        return out

    def close(self) -> list[str]:
        """Close the open block (at the end of the reply)."""
        out: list[str] = []
        if self._open == "thinking":
            sig = signature(self._thought)
            self.content[-1]["signature"] = sig
            if not self.omit_thinking:
                self.content[-1]["thinking"] = self._thought
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
        elif self._open == "tool_use":
            self.content[-1]["input"] = tool_input(self._args)
        if self._open is not None:
            out.append(event("content_block_stop", index=len(self.content) - 1))
        self._open, self._thought, self._args = None, "", ""
        return out

    def _open_block(self, kind: str, start: dict[str, Any], force: bool = False) -> list[str]:
        if self._open == kind and not force:
            return []
        out = self.close()
        self.content.append(dict(start))
        self._open = kind
        out.append(event("content_block_start", index=len(self.content) - 1, content_block=start))
        return out

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> str:
        return event("content_block_delta", index=len(self.content) - 1 if index is None else index, delta=delta)
