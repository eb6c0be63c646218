"""Responses input into chat messages, and Responses tools into the chat shape the core plans.

``input`` items become the messages a chat template renders:

- ``message`` (``type`` optional): roles user, system, developer (rendered as system: chat
  templates know no developer role) and assistant; content a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts, and ``input_image`` parts (an ``image_url``: a ``data:``
  URL, or a URL the server's media rules allow) in user messages. Files and audio are refused.
- ``function_call``: an assistant message with ``tool_calls`` (consecutive calls, and calls
  right after an assistant message, join that message, as chat templates expect).
- ``function_call_output``: a ``tool`` message answering ``call_id``.
- ``reasoning``: its text becomes the next assistant message's ``reasoning_content``.

Every refusal is a 400 naming the item (``input.3.type``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from llmserve import InvalidRequestError
from llmserve import ImagePart, image_from_url
from llmserve import arguments_as_object

log = logging.getLogger("llmserve.responses")

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def part_text(content: Any, param: str, images: list[ImagePart] | None = None, max_image_bytes: int = 0) -> Any:
    """A message's content (a string or a list of parts) as one string; with ``images`` (a user
    message), its ``input_image`` parts go there and the content is the list of text and
    ``{"type": "image"}`` parts that vision models' chat templates take."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param}: must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{param}.{i}"
        if kind in TEXT_PARTS:
            value = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(value, str):
                raise InvalidRequestError(f"{where}.text: must be a string", param=f"{where}.text")
            parts.append({"type": "text", "text": value})
        elif kind == "input_image" and images is not None:
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise InvalidRequestError(f"{where}.file_id: this server keeps no files; send the image as "
                                          "image_url", param=f"{where}.file_id")
            images.append(image_from_url(part.get("image_url"), f"{where}.image_url", max_image_bytes,
                                         part.get("detail"), detail_param=f"{where}.detail"))
            parts.append({"type": "image"})
        elif kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise InvalidRequestError(f"{where}: content type '{kind}' is not supported here", param=f"{where}.type")
        else:
            raise InvalidRequestError(f"{where}: unknown content part type {json.dumps(kind)[:40]}",
                                      param=f"{where}.type")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


class Conversation:
    """Builds the chat messages of a request from its instructions and input items."""

    def __init__(self, max_image_bytes: int = 0) -> None:
        self.messages: list[dict[str, Any]] = []
        self.images: list[ImagePart] = []  # the user messages' input_image parts, in order
        self.max_image_bytes = max_image_bytes
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
        images = self.images if role == "user" else None
        text = part_text(item["content"], f"{where}.content", images, self.max_image_bytes)
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
        namespace = item.get("namespace")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise InvalidRequestError(f"{where}.namespace: must be a non-empty string", param=f"{where}.namespace")
        if namespace:  # a call of a namespace tool: the model knows it by its flat name
            fields["name"] = flat_name(namespace, fields["name"])
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


NAMESPACE_SEPARATOR = "__"
Namespaces = dict[str, tuple[str, str]]  # a flat tool name -> (namespace, name)


def flat_name(namespace: str, name: str) -> str:
    """The name the model sees for ``name`` in ``namespace`` (``namespace__name``)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _function(tool: dict[str, Any], where: str, name: str | None = None) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError(f"{where}.name: must be a non-empty string", param=f"{where}.name")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    if name is not None:
        fn["name"] = name
    return {"type": "function", "function": fn}


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, Namespaces]:
    """Responses tools in the chat shape (``{type, function: {...}}``) ``llmserve.parsing.tool_choice``
    plans, and the namespace tools' flat names (``namespace__name`` -> (namespace, name)).

    ``function`` tools are taken as they are; a ``namespace`` tool (Codex sends its MCP servers'
    tools so) offers each of its function tools as ``namespace__name``, and calls of them come back
    with ``name`` and ``namespace``; hosted tools (``web_search``, ``file_search``, ...), which only
    OpenAI's servers run, are left out with a logged warning, as other local servers do, rather than
    failing the whole request."""
    if tools is None:
        return None, {}
    out: list[dict[str, Any]] = []
    namespaces: Namespaces = {}
    for i, tool in enumerate(tools):
        where, kind = f"tools.{i}", tool.get("type")
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "namespace":
            space, inner = tool.get("name"), tool.get("tools")
            if not isinstance(space, str) or not space or not isinstance(inner, list):
                raise InvalidRequestError(f"{where}: a namespace tool needs a name and a list of tools", param=where)
            for j, member in enumerate(inner):
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise InvalidRequestError(f"{where}.tools.{j}: a namespace holds function tools",
                                              param=f"{where}.tools.{j}")
                flat = flat_name(space, str(member.get("name")))
                out.append(_function(member, f"{where}.tools.{j}", flat))
                namespaces[flat] = (space, member["name"])
        elif isinstance(kind, str):
            log.warning("tools[%d]: the hosted tool type %r runs only on OpenAI's servers; left out", i, kind[:40])
        else:
            raise InvalidRequestError(f"{where}.type: must be a string", param=f"{where}.type")
    return out, namespaces


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, list[dict[str, Any]] | None]:
    """``tool_choice`` in the chat shape, and the tools it leaves offered (``allowed_tools``
    narrows them)."""
    if choice == "auto" and not tools:
        return None, tools  # the Responses default, sent explicitly by SDKs even with no tools
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name, space = choice.get("name"), choice.get("namespace")
        return {"type": "function", "function": {"name": flat_name(space, name) if space else name}}, tools
    if kind == "allowed_tools":
        allowed = choice.get("tools")
        mode = choice.get("mode")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise InvalidRequestError('tool_choice: allowed_tools needs mode "auto" or "required" and a list of '
                                      "tools", param="tool_choice")
        names = {flat_name(t["namespace"], t.get("name")) if t.get("namespace") else t.get("name")
                 for t in allowed if isinstance(t, dict) and t.get("type") == "function"}
        kept = [t for t in tools or [] if t["function"].get("name") in names]
        if not kept:
            raise InvalidRequestError("tool_choice: allowed_tools names none of the function tools given",
                                      param="tool_choice")
        return mode, kept
    raise InvalidRequestError(f"tool_choice: type {json.dumps(kind)[:40]} is not supported by this server "
                              '(none, auto, required, {"type": "function", "name"}, allowed_tools)',
                              param="tool_choice")
