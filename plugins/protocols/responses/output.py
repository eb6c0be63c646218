"""Parsed model output as Responses output items and the stream events that build them.

One ``OutputBuilder`` per response takes the parse chain's ``ParseDelta``s (or raw text when
nothing is parsed) and keeps the output items; every change is also an event in the
documented order. The non-streamed reply runs the same builder and drops the events, so a
streamed response and a non-streamed one of the same output are the same items.

Per item: ``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``;
for reasoning the same with ``response.reasoning_text.delta`` / ``.done``; for a function call
``response.function_call_arguments.delta``... and ``.done``; then ``response.output_item.done``.
An item closes when output of another kind begins (reasoning, then the answer, then calls).
Text that is only whitespace does not open an item (a newline before a tool call is no answer).
"""

from __future__ import annotations

import secrets
from typing import Any

from llmserve import ParseDelta

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputBuilder:
    """Output items of one response, built from parsed deltas; ``events`` collects the stream
    events not yet sent (``take()`` hands them over)."""

    def __init__(self, namespaces: dict[str, tuple[str, str]] | None = None) -> None:
        self.namespaces = namespaces or {}  # a namespace tool's flat name -> (namespace, name)
        self.items: list[dict[str, Any]] = []
        self.pending: list[Event] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._kind: str | None = None             # "message", "reasoning" or "function_call"
        self._held = ""                           # whitespace waiting for a non-blank character
        self._held_logprobs: list[dict[str, Any]] = []  # the logprobs of that whitespace
        self._calls: dict[int, dict[str, Any]] = {}  # parser call index -> its item

    def take(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out

    # -- feeding ---------------------------------------------------------------------------
    def add(self, delta: ParseDelta, logprobs: list[dict[str, Any]] | None = None) -> None:
        """Feed one parsed delta; ``logprobs`` (chat-style entries of the delta's tokens, when the
        request asked for them) go with its answer text."""
        if delta.reasoning:
            self._text("reasoning", delta.reasoning)
        if delta.content:
            self._text("message", delta.content, logprobs or [])
        for piece in delta.tool_calls:
            self._call_piece(piece.index, piece.id, piece.name, piece.arguments)

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        if self._kind != kind or self._open is None:
            if not (self._held + text).strip():
                self._held += text
                self._held_logprobs += logprobs or []
                return
            logprobs, self._held_logprobs = self._held_logprobs + (logprobs or []), []
            text, self._held = self._held + text, ""
            self._start(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": list(logprobs or [])} if kind == "message" else {}
        if kind == "message" and logprobs:
            part["logprobs"].extend(logprobs)
        self._emit(event, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text, **extra)

    def _start(self, kind: str) -> None:
        self.close()
        if kind == "message":
            item: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant",
                                    "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open, self._kind = item, kind
        index = len(self.items) - 1
        self._emit("response.output_item.added", output_index=index, item=_copy(item))
        item["content"].append(part)
        self._emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                   part=_part(part))

    def _call_piece(self, index: int, call_id: str | None, name: str | None, arguments: str) -> None:
        item = self._calls.get(index)
        if item is None:
            self.close()
            self._held, self._held_logprobs = "", []  # whitespace between the answer and a call belongs to neither
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call_id or new_id("call"), "name": name or "", "arguments": ""}
            if name in self.namespaces:  # a namespace tool's call: its own name, and its namespace
                item["namespace"], item["name"] = self.namespaces[name]
            self.items.append(item)
            self._calls[index] = item
            self._open, self._kind = item, "function_call"
            self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))
        elif item is not self._open:
            return  # a piece of a call already closed: parsers send calls in order
        if arguments:
            item["arguments"] += arguments
            self._emit("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=len(self.items) - 1, delta=arguments)

    # -- closing ---------------------------------------------------------------------------
    def close(self, status: str = "completed") -> None:
        """Close the open item (its ``.done`` events)."""
        item, self._open, self._kind = self._open, None, None
        if item is None:
            return
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=list(part["logprobs"]))
            else:
                self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"])
            self._emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=_part(part))
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def finish(self, incomplete: bool) -> None:
        """The output is over: close the open item (``incomplete`` when the output was cut off)."""
        self.close("incomplete" if incomplete else "completed")

    # -- reading ---------------------------------------------------------------------------
    def text(self, kind: str) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == kind and i["content"])

    def _emit(self, event: str, **fields: Any) -> None:
        self.pending.append({"type": event, **fields})


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part as it is now (its lists copied: the part itself keeps growing)."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in part.items()}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: ([_part(p) for p in v] if isinstance(v, list) else v) for k, v in item.items()}


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}
