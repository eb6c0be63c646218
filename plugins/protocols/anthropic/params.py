"""Anthropic request fields -> what the core understands: chat-template messages, the tool plan
(``llmserve.parsing.tool_choice``), the output constraint, sampling; and the reverse for replies
(stop reasons, tool-use ids, thinking signatures).

History is turned into the message shape chat templates know (the OpenAI one): ``system`` and
text blocks become ``content``; an assistant's ``tool_use`` blocks its ``tool_calls`` (arguments
as an object) and its ``thinking`` blocks ``reasoning_content``; each ``tool_result`` becomes a
``role: "tool"`` message; a user message's ``image`` blocks (base64 or url sources) become the
request's images (``llmserve.media.parts``), ``{"type": "image"}`` parts where they were.
Document blocks are refused with a 400 naming the block.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from llmserve import InvalidRequestError
from llmserve import ImagePart, image_from_base64, image_from_url
from llmserve import GuidedSpec
from llmserve import AUTO_FLAGS
from llmserve import effort_budget
from llmserve import RequestPolicy
from llmserve import SamplingParams

from .wire import BILLING_PREFIX, CountTokensRequest, MessagesRequest

UNSUPPORTED_BLOCKS = {"document": "document (PDF or text source)",
                      "search_result": "search result", "container_upload": "container upload"}
# output_config keys this server reads; any other is refused rather than silently dropped,
# since it may constrain the output.
OUTPUT_CONFIG_KEYS = {"format", "effort"}


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}: must be a string", param=where)
    return value


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{where}: a content block must be an object with a string `type`", param=where)
    if kind in UNSUPPORTED_BLOCKS:
        raise InvalidRequestError(f"{where}: {UNSUPPORTED_BLOCKS[kind]} blocks are not supported by this server; "
                                  f"send text blocks", param=where)
    return kind


def system_text(system: Any, drop_billing: bool = False) -> str | None:
    """``system`` as one string (text blocks joined by newlines), or None. With ``drop_billing``,
    Claude Code's billing line (``x-anthropic-billing-header: ...; cch=<nonce>;``) is left out."""
    if isinstance(system, str):
        system = [{"type": "text", "text": system}]
    if not system:
        return None
    return _joined_text(system, "system", "system blocks must be text blocks", drop_billing) or None


def _joined_text(blocks: list[Any], where: str, refusal: str, drop_billing: bool = False) -> str:
    """The texts of a list of text blocks, joined by newlines; any other block is a 400."""
    parts = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if _block_type(block, at) != "text":
            raise InvalidRequestError(f"{at}: {refusal}", param=at)
        text = _text(block.get("text"), f"{at}.text")
        if drop_billing and text.startswith(BILLING_PREFIX):
            # The block is one line; a client that ran other text on after it keeps that text.
            text = text.partition("\n")[2]
            if not text:
                continue
        parts.append(text)
    return "\n".join(parts)


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content: must be a string or a list of text blocks",
                                  param=f"{where}.content")
    return _joined_text(content, f"{where}.content", "tool results may hold text blocks only")


IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image(block: dict[str, Any], where: str, max_bytes: int) -> ImagePart:
    """An ``image`` block's source as the request's image part."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        mime = source.get("media_type")
        if mime not in IMAGE_TYPES:
            raise InvalidRequestError(f"{where}.source.media_type: must be one of {', '.join(IMAGE_TYPES)}",
                                      param=f"{where}.source.media_type")
        return image_from_base64(source.get("data"), f"{where}.source.data", max_bytes, mime)
    if kind == "url":
        assert isinstance(source, dict)
        return image_from_url(source.get("url"), f"{where}.source.url", max_bytes)
    raise InvalidRequestError(f"{where}.source: an image needs a source of type base64 or url",
                              param=f"{where}.source")


def chat_messages(body: CountTokensRequest, drop_billing: bool = False, images: list[ImagePart] | None = None,
                  max_image_bytes: int = 0) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (system first). ``system`` messages inside
    ``messages`` (their text blocks only) are folded into that one system message, after the
    ``system`` field, in order: chat templates take a system message first, if anywhere.
    ``drop_billing``: the ``anthropic:`` option ``billing_header: drop`` (see ``system_text``).
    User messages' image blocks go to ``images`` (refused when it is None)."""
    out: list[dict[str, Any]] = []
    systems = [system_text(body.system, drop_billing)]
    systems += [system_text(m.content, drop_billing) if isinstance(m.content, str) else
                _joined_text(m.content, f"messages.{i}.content", "system messages hold text blocks only", drop_billing)
                for i, m in enumerate(body.messages) if m.role == "system"]
    system = "\n\n".join(s for s in systems if s)
    if system:
        out.append({"role": "system", "content": system})
    tool_names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer it
    for i, message in enumerate(body.messages):
        if message.role == "system":
            continue
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        texts: list[str] = []
        parts: list[dict[str, Any]] = []  # texts and images in order, for a message with images
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            kind = _block_type(block, where)
            if kind == "text":
                texts.append(_text(block.get("text"), f"{where}.text"))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind == "image":
                if message.role != "user" or images is None:
                    raise InvalidRequestError(f"{where}: image blocks belong in user messages", param=where)
                images.append(_image(block, where, max_image_bytes))
                parts.append({"type": "image"})
            elif kind in ("tool_use", "thinking", "redacted_thinking") and message.role != "assistant":
                raise InvalidRequestError(f"{where}: {kind} blocks belong in assistant messages", param=where)
            elif kind == "tool_use":
                call_id, name = _text(block.get("id"), f"{where}.id"), _text(block.get("name"), f"{where}.name")
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise InvalidRequestError(f"{where}.input: must be an object", param=f"{where}.input")
                tool_names[call_id] = name
                calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            elif kind == "thinking":
                thinking.append(_text(block.get("thinking"), f"{where}.thinking"))
            elif kind == "redacted_thinking":
                continue  # opaque to any model but the one that wrote it
            elif kind == "tool_result":
                if message.role != "user":
                    raise InvalidRequestError(f"{where}: tool_result blocks belong in user messages", param=where)
                call_id = _text(block.get("tool_use_id"), f"{where}.tool_use_id")
                if call_id not in tool_names:
                    raise InvalidRequestError(f"{where}.tool_use_id: no earlier tool_use block has the id "
                                              f"{call_id!r}", param=f"{where}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": call_id, "name": tool_names[call_id],
                                "content": _tool_result_text(block, where)})
            else:
                raise InvalidRequestError(f"{where}: unknown content block type {kind!r} (this server reads text, "
                                          f"tool_use, tool_result, thinking and redacted_thinking)", param=where)
        out.extend(results)  # tool results answer the previous turn: before this turn's text
        if message.role == "assistant":
            out.append(_assistant(texts, calls, thinking))
        elif len(parts) > len(texts):  # images among the texts: the parts, as vision templates take them
            out.append({"role": "user", "content": parts})
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    if not any(m["role"] != "system" for m in out):
        raise InvalidRequestError("messages: at least one user or assistant message is required", param="messages")
    return out


def _assistant(texts: list[str], calls: list[dict[str, Any]], thinking: list[str]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def is_prefill(body: CountTokensRequest) -> bool:
    """A last assistant message with text and no tool use: the reply continues it."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    if isinstance(last.content, str):
        return bool(last.content.strip())
    kinds = [b.get("type") for b in last.content if isinstance(b, dict)]
    return "text" in kinds and "tool_use" not in kinds


def function_tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The request's tools as function tools (the shape tool plans and chat templates take)."""
    if body.tools is None:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(f"tools.{i}: server tools ({tool.type!r}) are not supported by this server; "
                                      f"give client tools with a name and an input_schema", param=f"tools.{i}.type")
        if not isinstance(tool.input_schema, dict):
            raise InvalidRequestError(f"tools.{i}.input_schema: a JSON schema object is required",
                                      param=f"tools.{i}.input_schema")
        fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out


def tool_fields(body: CountTokensRequest, auto_enabled: bool,
                why: str = "") -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """``tools`` / ``tool_choice`` in OpenAI's shapes ``(tools, tool_choice, parallel)``, for the
    core to plan exactly as the OpenAI dialect's: ``any`` is ``required`` and ``tool`` a named
    function (both forced by guided decoding), ``auto`` needs the server's tool parser
    (``auto_enabled``: ``--enable-auto-tool-choice`` with a ``--tool-call-parser``; ``why`` it is
    off, for the 400)."""
    tools = function_tools(body)
    choice = body.tool_choice
    kind = choice.type if choice is not None else ("auto" if tools else "none")
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if kind != "none" and not tools:
        raise InvalidRequestError("tool_choice: tools must be given unless tool_choice is none", param="tool_choice")
    if kind == "auto" and not auto_enabled:
        raise InvalidRequestError(f'tool_choice "auto" (the default when tools are given) requires {AUTO_FLAGS} '
                                  f'on the server{why}; send tool_choice {{"type": "any"}}, {{"type": "tool", '
                                  f'"name": ...}} or {{"type": "none"}} instead', param="tool_choice")
    if kind == "tool":
        if not choice or not choice.name:
            raise InvalidRequestError("tool_choice.name: required when tool_choice.type is tool",
                                      param="tool_choice.name")
        openai_choice: Any = {"type": "function", "function": {"name": choice.name}}
    else:
        openai_choice = {"any": "required"}.get(kind, kind)
    return tools, openai_choice, parallel


def offered_tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The tools a create request would show the chat template (none under tool_choice none),
    without the server-flag rules: counting tokens never needs a tool parser."""
    if body.tool_choice is not None and body.tool_choice.type == "none":
        return None
    return function_tools(body) or None


def template_kwargs(body: CountTokensRequest) -> dict[str, Any]:
    """``thinking`` as the switches chat templates read (Qwen3 ``enable_thinking``, others
    ``thinking``); the reasoning parser sees the same values."""
    if body.thinking is None:
        return {}
    on = body.thinking.type != "disabled"
    return {"enable_thinking": on, "thinking": on}


def thinking_budget(context: Any, body: MessagesRequest) -> int | None:
    """The thinking budget Anthropic's fields ask for: ``thinking.budget_tokens`` (which must be
    below ``max_tokens``, as Anthropic requires), else ``output_config.effort`` through the
    server's effort table (``max``: no budget); none while thinking is disabled."""
    thinking = body.thinking
    if thinking is not None and thinking.type == "disabled":
        return None
    if thinking is not None and thinking.budget_tokens is not None:
        if thinking.budget_tokens >= body.max_tokens:
            raise InvalidRequestError(f"`max_tokens` must be greater than `thinking.budget_tokens` "
                                      f"({body.max_tokens} <= {thinking.budget_tokens})", param="max_tokens")
        return thinking.budget_tokens
    effort = (body.output_config or {}).get("effort")
    if effort is None or effort == "max":
        return None
    if not isinstance(effort, str):
        raise InvalidRequestError("output_config.effort: must be a string", param="output_config.effort")
    return effort_budget(context, effort, "output_config.effort")


def output_spec(body: CountTokensRequest) -> GuidedSpec | None:
    """``output_config.format`` (or the beta's ``output_format``) as a JSON-schema constraint."""
    config = body.output_config or {}
    unknown = sorted(set(config) - OUTPUT_CONFIG_KEYS)
    if unknown:
        raise InvalidRequestError(f"output_config.{unknown[0]}: not supported by this server (it reads format "
                                  f"and accepts effort)", param=f"output_config.{unknown[0]}")
    given = [(name, fmt) for name, fmt in (("output_config.format", config.get("format")),
                                           ("output_format", body.output_format)) if fmt is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError("give output_config.format or output_format, not both", param="output_format")
    param, fmt = given[0]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(f'{param}: only {{"type": "json_schema", "schema": {{...}}}} is supported',
                                  param=f"{param}.type")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError(f"{param}.schema: a JSON schema object is required", param=f"{param}.schema")
    return GuidedSpec("json_schema", fmt["schema"], param=param)


# Anthropic clients send their model's output cap as max_tokens (Claude Code: 32000), not a
# length they need: past the context window it is capped, and a reply cut there says
# model_context_window_exceeded.
POLICY = RequestPolicy(prompt="messages", names={"stop": "stop_sequences"}, length="cap")


def sampling(body: MessagesRequest) -> SamplingParams:
    for i, stop in enumerate(body.stop_sequences or []):
        if not stop:
            raise InvalidRequestError(f"stop_sequences.{i}: must not be empty", param=f"stop_sequences.{i}")
    return SamplingParams.build(POLICY.names, max_tokens=body.max_tokens, temperature=body.temperature,
                                top_p=body.top_p, top_k=body.top_k, stop=list(body.stop_sequences or []))


def stop_reason(finish: str | None, stop: str | int | None, called: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str) and stop in (stop_sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` prefix on the parse chain's call id."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object ({} when empty or not an object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: a SHA-256 digest of its text. The SDK and clients
    expect the field; this server does not verify signatures sent back in history."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()
