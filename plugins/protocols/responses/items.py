"""Responses input into chat messages, and Responses tools into the chat shape the core plans.

``input`` items become the messages a chat template renders:

- ``message`` (``type`` optional): roles user, system, developer (rendered as system: chat
  templates know no developer role) and assistant; content a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts. Images, files and audio are refused.
- ``function_call``: an assistant message with ``tool_calls`` (consecutive calls, and calls
  right after an assistant message, join that message, as chat templates expect).
- ``function_call_output``: a ``tool`` message answering ``call_id``.
- ``reasoning``: its text becomes the next assistant message's ``reasoning_content``.

Every refusal is a 400 naming the item (``input.3.type``).
"""

from __future__ import annotations

import json
from typing import Any

from llmserve import InvalidRequestError
from llmserve import arguments_as_object

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def part_text(content: Any, param: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param}: must be a string or a list of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{param}.{i}"
        if kind in TEXT_PARTS:
            value = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(value, str):
                raise InvalidRequestError(f"{where}.text: must be a string", param=f"{where}.text")
            texts.append(value)
        elif kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise InvalidRequestError(f"{where}: content type '{kind}' is not supported by this server "
                                      "(text only)", param=f"{where}.type")
        else:
            raise InvalidRequestError(f"{where}: unknown content part type {json.dumps(kind)[:40]}",
                                      param=f"{where}.type")
    return "".join(texts)


class Conversation:
    """Builds the chat messages of a request from its instructions and input items."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._names: dict[str, str] = {}  # call_id -> function name, for tool messages

    def add_items(self, items: list[Any], param: str = "input") -> None:
        for i, item in enumerate(items):
            where = f"{param}.{i}"
            if not isinstance(item, dict):
                raise InvalidRequestError(f"{where}: must be an object", param=where)
            kind = item.get("type", "message")
            if kind == "message":
                self._message(item, where)
            elif kind == "function_call":
                self._call(item, where)
            elif kind == "function_call_output":
                self._output(item, where)
            elif kind == "reasoning":
                self._reasoning_item(item, where)
            elif isinstance(kind, str):
                raise InvalidRequestError(f"{where}: input item type '{kind[:40]}' is not supported by this server "
                                          "(message, function_call, function_call_output, reasoning)",
                                          param=f"{where}.type")
            else:
                raise InvalidRequestError(f"{where}.type: must be a string", param=f"{where}.type")

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role: must be one of user, system, developer, assistant; "
                                      f"got {json.dumps(role)[:40]}", param=f"{where}.role")
        if "content" not in item:
            raise InvalidRequestError(f"{where}.content: required", param=f"{where}.content")
        text = part_text(item["content"], f"{where}.content")
        message: dict[str, Any] = {"role": ROLES[role], "content": text}
        if role == "assistant":
            self._take_reasoning(message)
        self.messages.append(message)

    def _take_reasoning(self, message: dict[str, Any]) -> None:
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
            self._reasoning = []

    def _call(self, item: dict[str, Any], where: str) -> None:
        fields = {}
        for key in ("call_id", "name", "arguments"):
            value = item.get(key)
            if not isinstance(value, str) or (key != "arguments" and not value):
                raise InvalidRequestError(f"{where}.{key}: must be a non-empty string" if key != "arguments"
                                          else f"{where}.arguments: must be a string (JSON)", param=f"{where}.{key}")
            fields[key] = value
        call = {"id": fields["call_id"], "type": "function",
                "function": {"name": fields["name"], "arguments": fields["arguments"]}}
        arguments_as_object(call)
        self._names[fields["call_id"]] = fields["name"]
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and not self._reasoning:
            last.setdefault("tool_calls", []).append(call)
            return
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        self._take_reasoning(message)
        self.messages.append(message)

    def _output(self, item: dict[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{where}.call_id: must be a non-empty string", param=f"{where}.call_id")
        if "output" not in item:
            raise InvalidRequestError(f"{where}.output: required", param=f"{where}.output")
        text = part_text(item["output"], f"{where}.output")
        message = {"role": "tool", "tool_call_id": call_id, "content": text}
        name = item.get("name") if isinstance(item.get("name"), str) else self._names.get(call_id)
        if name:
            message["name"] = name
        self.messages.append(message)

    def _reasoning_item(self, item: dict[str, Any], where: str) -> None:
        # The reasoning text is in ``content`` (reasoning_text parts); ``summary`` is what a
        # client shows when there is no full text. Encrypted reasoning cannot be read: skipped.
        for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
            parts = item.get(key)
            if parts is None:
                continue
            if not isinstance(parts, list):
                raise InvalidRequestError(f"{where}.{key}: must be a list", param=f"{where}.{key}")
            texts = []
            for j, part in enumerate(parts):
                if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"{where}.{key}[{j}]: must be {{\"type\": \"{kind}\", \"text\": ...}}",
                                              param=f"{where}.{key}.{j}")
                texts.append(part["text"])
            if texts:
                self._reasoning.append("\n".join(texts))
                return


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: ``{type, name, parameters, ...}``) in the chat shape
    (``{type, function: {...}}``) ``llmserve.parsing.tool_choice`` plans; other tool types are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}]: tool type {json.dumps(kind)[:40]} is not supported by this "
                                      "server (only \"function\" tools)", param=f"tools.{i}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """``tool_choice`` in the chat shape, and the tools it leaves offered (``allowed_tools``
    narrows them)."""
    if choice == "auto" and not tools:
        return None, tools  # the Responses default, sent explicitly by SDKs even with no tools
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}, tools
    if kind == "allowed_tools":
        allowed = choice.get("tools")
        mode = choice.get("mode")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequestError('tool_choice: allowed_tools needs mode "auto" or "required" and a list of '
                                      "tools", param="tool_choice")
        names = {t.get("name") for t in allowed if isinstance(t, dict) and t.get("type") == "function"}
        kept = [t for t in tools or [] if t["function"].get("name") in names]
        if not kept:
            raise InvalidRequestError("tool_choice: allowed_tools names none of the function tools given",
                                      param="tool_choice")
        return mode, kept
    raise InvalidRequestError(f"tool_choice: type {json.dumps(kind)[:40]} is not supported by this server "
                              '(none, auto, required, {"type": "function", "name"}, allowed_tools)',
                              param="tool_choice")
