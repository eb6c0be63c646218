"""Prompts of ``/api/chat`` and ``/api/generate``: Ollama messages -> the chat template's
messages, and ``/api/generate``'s prompt from ``system``, ``template``, ``raw`` and ``context``.

``template`` is a Go template in Ollama. The subset that prompt templates use is rendered here:
``{{ .System }}``, ``{{ .Prompt }}``, ``{{ .Response }}`` (the prompt ends where the response
would start), ``{{ if .X }} ... {{ else }} ... {{ end }}`` (not nested) and the ``{{-``/``-}}``
trim markers. Anything else is a 400 naming the construct, never a silently wrong prompt.
"""

from __future__ import annotations

import re
from typing import Any

from llmserve import InvalidRequestError
from llmserve import ImagePart, image_from_base64
from llmserve import arguments_as_object, render_chat

from .wire import GenerateRequest, Message

ROLES = ("system", "user", "assistant", "tool")
_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)
_FIELDS = ("System", "Prompt", "Response")
NO_TEMPLATE = "the served model has no chat template: use /api/generate with raw set to true"


def ollama_images(images: Any, param: str, max_bytes: int) -> list[ImagePart]:
    """Ollama's ``images`` (base64 strings) as the request's image parts."""
    if not isinstance(images, list):
        raise InvalidRequestError(f"{param}: must be a list of base64 strings", param=param)
    return [image_from_base64(image, f"{param}.{k}", max_bytes) for k, image in enumerate(images)]


def template_messages(messages: list[Message], images: list[ImagePart],
                      max_image_bytes: int) -> tuple[list[dict[str, Any]], bool]:
    """The chat template's messages, and whether to continue the last one (an assistant
    message with text and no calls is continued, as Ollama does, instead of answered). A
    message's ``images`` go to ``images``; its content is then the image parts, then its text."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.role[:20]!r}",
                                      param=f"messages.{i}.role")
        content: Any = m.content or ""
        if m.images:
            found = ollama_images(m.images, f"messages.{i}.images", max_image_bytes)
            images.extend(found)
            content = [{"type": "image"} for _ in found] + [{"type": "text", "text": content}]
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            # Ollama sends arguments as objects; a string holding one (as OpenAI clients send) is decoded.
            calls = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                      "function": {"name": c.function.name,
                                   "arguments": {} if c.function.arguments is None else c.function.arguments}}
                     for j, c in enumerate(m.tool_calls)]
            for call in calls:
                arguments_as_object(call)
            msg["tool_calls"] = calls
        if m.tool_name:  # templates read the tool's name as `name` (OpenAI style) or `tool_name`
            msg["name"] = msg["tool_name"] = m.tool_name
        out.append(msg)
    last = messages[-1] if messages else None
    continue_last = last is not None and last.role == "assistant" and bool(last.content) and not last.tool_calls
    return out, continue_last


def go_template(source: str, values: dict[str, str]) -> str:
    """Render the Go-template subset described above; the output stops at ``{{ .Response }}``."""
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (condition, in else branch) of each open `if`
    pos, trim_next = 0, False

    def emitting() -> bool:
        return all(cond != in_else for cond, in_else in stack)

    for match in _ACTION.finditer(source):
        text = source[pos:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if emitting():
            out.append(text)
        pos, trim_next = match.end(), bool(match.group(3))
        action = match.group(2)
        field = re.fullmatch(r"\.(\w+)", action)
        cond = re.fullmatch(r"if\s+\.(\w+)", action)
        if field and field.group(1) in _FIELDS:
            if field.group(1) == "Response":
                if stack:
                    raise InvalidRequestError("template: {{ .Response }} inside an if block is not supported",
                                              param="template")
                return "".join(out)
            if emitting():
                out.append(values.get(field.group(1), ""))
        elif cond and cond.group(1) in _FIELDS:
            if stack:
                raise InvalidRequestError("template: nested if blocks are not supported", param="template")
            stack.append((bool(values.get(cond.group(1))), False))
        elif action == "else" and stack and not stack[-1][1]:
            stack[-1] = (stack[-1][0], True)
        elif action == "end" and stack:
            stack.pop()
        else:
            raise InvalidRequestError(f"template: {{{{ {action[:40]} }}}} is not supported (supported: .System, "
                                      ".Prompt, .Response, if/else/end)", param="template")
    if stack:
        raise InvalidRequestError("template: an if block is not closed with {{ end }}", param="template")
    tail = source[pos:]
    out.append(tail.lstrip() if trim_next else tail)
    return "".join(out)


def generate_prompt(tokenizer: Any, body: GenerateRequest, kwargs: dict[str, Any],
                    timeout: float) -> tuple[str, bool]:
    """``(prompt text, whether the tokenizer should add its special tokens)`` of a generate body.
    Through the chat template, the body's ``images`` come first in the user message, as Ollama
    places them; a raw or templated prompt holds the model's own placeholders itself."""
    prompt, system = body.prompt or "", body.system or ""
    if body.raw:
        return prompt, True
    if body.template:
        return go_template(body.template, {"System": system, "Prompt": prompt}), False
    if not getattr(tokenizer, "chat_template", None):  # a base model: the text is the prompt
        return (system + "\n\n" + prompt if system else prompt), True
    content: Any = prompt
    if body.images:
        content = [*({"type": "image"} for _ in body.images), {"type": "text", "text": prompt}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return render_chat(tokenizer, messages, add_generation_prompt=True, template_kwargs=kwargs,
                       timeout=timeout), False
