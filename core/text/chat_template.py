"""Rendering chat messages with the model's (or a request's) template, in jinja2's sandbox."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from llmserve.errors import InvalidRequestError


def message_text(content: Any, index: int) -> str | None:
    """Flatten OpenAI content (a string or a list of parts) to text; only text parts are allowed."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise InvalidRequestError(f"messages[{index}].content: only text content parts are supported",
                                      param=f"messages.{index}.content")
    return "\n".join(parts)


def _raise(message: str) -> None:
    raise TemplateRaised(message)


class TemplateRaised(Exception):
    """A template called raise_exception(): its message is meant for the client."""


class TemplateTooCostly(Exception):
    """Rendering ran past its time cap or its output size cap."""


# Largest prompt text a template may produce; far above any context window, far below a
# memory problem. Checked as output is produced, and on `*` (string or list repetition).
MAX_RENDER_CHARS = 16 * 1024 * 1024
TEMPLATE_FILENAME = "<template>"  # what jinja2 names the code it compiles from a string


def _checked_repeat(left: Any, right: Any) -> Any:
    """``*`` in templates: refuse repetitions that would build a huge string or list at once."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * max(count,
                                                                                             0) > MAX_RENDER_CHARS:
            raise TemplateTooCostly(f"the chat template builds a value of more than {MAX_RENDER_CHARS} items")
    return left * right


def _checked_power(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
        raise TemplateTooCostly("the chat template computes a number that is too large")
    return left ** right


class _Deadline:
    """A trace function that stops template code once its time is up.

    jinja2 compiles a template to Python functions whose code is named ``<template>``; only
    those frames get line tracing, and every line (each loop iteration included, even of an
    empty loop body) checks the clock. A thread cannot be killed from outside, so the check
    has to run inside the rendering itself.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == TEMPLATE_FILENAME:
            return self._line
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > self.deadline:
            raise TemplateTooCostly(f"the chat template took longer than {self.seconds:g} s to render")
        return self._line


def _render_capped(template: Any, context: dict[str, Any], timeout: float | None) -> str:
    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    if timeout is not None:
        sys.settrace(_Deadline(timeout))
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise TemplateTooCostly(f"the chat template produced more than {MAX_RENDER_CHARS} characters")
            parts.append(chunk)
    finally:
        if timeout is not None:
            sys.settrace(previous)
    return "".join(parts)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    """Compile once per template text, in an immutable sandbox (no attribute writes, no I/O)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    # The sandbox stops attribute escapes but not CPU or memory bombs: cap the two operators
    # that build huge values in one step (the render deadline covers loops).
    env.intercepted_binops = frozenset({"*", "**"})
    env.call_binop = lambda context, operator, left, right: (  # type: ignore[method-assign]
        _checked_repeat(left, right) if operator == "*" else _checked_power(left, right) if operator == "**"
        else env.binop_table[operator](left, right))
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            out[name] = value
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                documents: list[dict] | None = None, timeout: float | None = None) -> str:
    """Return the prompt text for ``messages``.

    ``timeout`` (seconds) caps the rendering time; past it, or past ``MAX_RENDER_CHARS`` of
    output, the request fails with a 400. Run this off the event loop (``asyncio.to_thread``)
    so that a slow template delays only its own request.
    """
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
    source = chat_template or getattr(tokenizer, "chat_template", None)
    if not source:
        raise InvalidRequestError("this model has no chat template; send a chat_template or use completions",
                                  param="messages")
    context = {**special_tokens(tokenizer), **(template_kwargs or {})}
    context.update(messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
    try:
        text = _render_capped(compile_template(source), context, timeout)
    except TemplateRaised as exc:
        raise InvalidRequestError(str(exc), param="messages") from None
    except TemplateTooCostly as exc:
        raise InvalidRequestError(f"{exc}; the request was refused",
                                  param="chat_template" if chat_template else "messages") from None
    except Exception as exc:  # noqa: BLE001 - a broken template is the caller's input
        raise InvalidRequestError(f"the chat template could not be rendered: {type(exc).__name__}: {exc}",
                                  param="chat_template" if chat_template else "messages") from None
    if continue_final_message:
        # Cut everything the template appended after the final message's content.
        last = messages[-1].get("content") if messages else None
        if isinstance(last, str) and last.strip() and last.strip() in text:
            text = text[: text.rindex(last.strip()) + len(last.strip())]
    return text
