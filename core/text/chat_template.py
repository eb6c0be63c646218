"""Rendering chat messages with the model's (or a request's) template, in jinja2's sandbox."""

from __future__ import annotations

import json
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    """Compile once per template text, in an immutable sandbox (no attribute writes, no I/O)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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
                documents: list[dict] | None = None) -> str:
    """Return the prompt text for ``messages``."""
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
        text = compile_template(source).render(**context)
    except TemplateRaised as exc:
        raise InvalidRequestError(str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a broken template is the caller's input
        raise InvalidRequestError(f"the chat template could not be rendered: {type(exc).__name__}: {exc}",
                                  param="messages") from None
    if continue_final_message:
        # Cut everything the template appended after the final message's content.
        last = messages[-1].get("content") if messages else None
        if isinstance(last, str) and last.strip() and last.strip() in text:
            text = text[: text.rindex(last.strip()) + len(last.strip())]
    return text
