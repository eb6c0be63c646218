"""Rendering chat messages with the model's (or a request's) template, in a capped jinja2
sandbox (``llmserve.text.sandbox``), under a wall-clock deadline."""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from llmserve.engine.gil import quick_handoff
from llmserve.errors import InvalidRequestError
from llmserve.request_context import current_context
from llmserve.text.sandbox import MAX_RENDER_CHARS, CappedSandbox, TemplateTooCostly

log = logging.getLogger("llmserve.text")

#: The response header that says the model was not shown the request's tools.
TOOLS_WARNING = ("tools-not-in-prompt: the chat template left the request's tools out of the prompt, so the model "
                 "cannot see them; serve with --chat-template set to a template that renders tools")
_tools_warning_logged = False  # the log line comes once per server; the header on every such response

__all__ = ["MAX_RENDER_CHARS", "TemplateTooCostly", "render_chat", "render_template", "compile_template",
           "message_text", "message_content", "content_text", "template_kwargs_for", "RESERVED_TEMPLATE_KWARGS"]

#: ``chat_template_kwargs`` keys a request may not set: arguments of the rendering call itself
#: in other servers (``tokenize``, ``chat_template``, ``return_dict``... of transformers'
#: ``apply_chat_template``, which some servers splat the kwargs into) and the variables this
#: server sets. Any other key reaches the template only if the template reads that variable.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "tokenize", "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs", "tokenizer", "conversation",
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
    "range", "dict", "namespace", "lipsum", "cycler", "joiner",
})


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


def message_content(content: Any, index: int, images: list[Any], max_image_bytes: int) -> Any:
    """OpenAI content with its ``image_url`` parts taken out into ``images`` (``ImagePart``s, each
    naming its field): text when the message has no image, else the parts as vision models'
    chat templates take them (``{"type": "text", "text": ...}`` and ``{"type": "image"}``)."""
    if content is None or isinstance(content, str):
        return content
    from llmserve.media.parts import image_from_url

    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages.{index}.content.{j}"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            value = part.get("image_url")
            url, detail = (value.get("url"), value.get("detail")) if isinstance(value, dict) else (value, None)
            images.append(image_from_url(url, f"{where}.image_url", max_image_bytes, detail))
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(f"messages[{index}].content: only text and image_url content parts are "
                                      "supported", param=where)
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def content_text(content: Any) -> str:
    """The text of chat-template content: a string, or the text parts of a list joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def arguments_as_object(call: Any) -> None:
    """Decode a history tool call's ``function.arguments`` in place when it is a JSON string
    holding an object: the wire formats send a string, while chat templates (Llama 3.1, Qwen,
    Hermes, ...) expect the object. Anything else is left as sent."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            value = json.loads(fn["arguments"])
        except ValueError:
            return  # not JSON: the template gets the text as sent
        if isinstance(value, dict):
            fn["arguments"] = value


def _raise(message: str) -> None:
    raise TemplateRaised(message)


class TemplateRaised(Exception):
    """A template called raise_exception(): its message is meant for the client."""


class _Deadline:
    """A trace function that stops template code once its time is up.

    Every Python frame the rendering runs gets line tracing: the template's own code
    (compiled by jinja2; each loop iteration checks the clock, even of an empty loop body)
    and the filters it calls (``wordwrap``, ``batch``... loop in Python too). A thread cannot
    be killed from outside, so the check has to run inside the rendering itself; operations
    that run in C in one step are size-checked before they start (``llmserve.text.sandbox``).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line

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
        with quick_handoff():  # a long render must not slow the engine thread down
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

    env = CappedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_template(source: str, context: dict[str, Any], timeout: float | None = None) -> str:
    """``source`` rendered with ``context`` alone, in the capped sandbox and under ``timeout``
    seconds: what the server runs, with none of a request's rules (``llmserve.parsing.detect``
    renders its probe conversation with it). Raises what the template raises, ``TemplateRaised``
    for its ``raise_exception`` and ``TemplateTooCostly`` past the caps."""
    return _render_capped(compile_template(source), context, timeout)


def server_template(value: str) -> str:
    """The template ``--chat-template`` names: a file's contents when ``value`` is an existing
    file, else ``value`` itself when it looks like a template. Checked as the model's own
    template is (sandbox vetting, syntax), so a bad one stops the server at start, not each
    request. Raises ``ConfigError``."""
    from pathlib import Path

    from llmserve.errors import ConfigError
    from llmserve.text.sandbox import vet_template

    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif any(mark in value for mark in ("{{", "{%")):
        source = value
    else:
        raise ConfigError(f"--chat-template: {value!r} is neither a file nor a template (a file path that "
                          f"does not exist?)")
    why = vet_template(source)
    if why is not None:
        raise ConfigError(f"--chat-template was refused: {why} (a jinja template-injection payload)")
    try:
        compile_template(source)
    except Exception as exc:  # noqa: BLE001 - jinja's syntax errors, one line
        raise ConfigError(f"--chat-template is not a valid template: {type(exc).__name__}: {exc}") from None
    return source


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads from its context (what ``chat_template_kwargs`` may set)."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(CappedSandbox().parse(source)))


def template_kwargs_for(source: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` that reach the template: a reserved key is a 400
    naming it; a key the template does not read is dropped (clients send ``enable_thinking``
    to every model, and only some templates read it)."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier() or key.startswith("_"):
            raise InvalidRequestError(f"chat_template_kwargs: the key {key!r} may not be set by a request (the "
                                      f"server sets it, or it is not a template variable)",
                                      param="chat_template_kwargs")
    wanted = template_variables(source)
    return {k: v for k, v in kwargs.items() if k in wanted}


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
                documents: list[dict] | None = None, timeout: float | None = None,
                trusted: bool = False) -> str:
    """Return the prompt text for ``messages``.

    ``chat_template`` is a request's own template: refused unless ``trusted`` (the server's
    ``--trust-request-chat-template``). ``template_kwargs`` go through ``template_kwargs_for``.
    ``timeout`` (seconds) caps the rendering time; past it, or past ``MAX_RENDER_CHARS`` of
    output or of any value built on the way, the request fails with a 400. Run this off the
    event loop (``asyncio.to_thread``) so that a slow template delays only its own request.
    """
    if chat_template is not None and not trusted:
        raise InvalidRequestError("chat_template in requests is disabled on this server "
                                  "(start it with --trust-request-chat-template)", param="chat_template")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  param="continue_final_message")
    source = chat_template or getattr(tokenizer, "chat_template", None)
    if not source:
        raise InvalidRequestError("this model has no chat template; send a chat_template or use completions",
                                  param="messages")
    try:
        context = {**special_tokens(tokenizer), **template_kwargs_for(source, template_kwargs)}
        context.update(messages=messages, tools=tools, documents=documents,
                       add_generation_prompt=add_generation_prompt)
        text = _render_capped(compile_template(source), context, timeout)
    except InvalidRequestError:
        raise
    except TemplateRaised as exc:
        raise InvalidRequestError(str(exc), param="messages") from None
    except TemplateTooCostly as exc:
        raise InvalidRequestError(f"{exc}; the request was refused",
                                  param="chat_template" if chat_template else "messages") from None
    except Exception as exc:  # noqa: BLE001 - a broken template is the caller's input
        raise InvalidRequestError(f"the chat template could not be rendered: {type(exc).__name__}: {exc}",
                                  param="chat_template" if chat_template else "messages") from None
    if tools:
        _check_tools_rendered(tools, text)
    if continue_final_message:
        # Cut everything the template appended after the final message's content.
        last = messages[-1].get("content") if messages else None
        if isinstance(last, str) and last.strip() and last.strip() in text:
            text = text[: text.rindex(last.strip()) + len(last.strip())]
    return text


def _check_tools_rendered(tools: list[dict], text: str) -> None:
    """Flag a template that drops ``tools`` (SmolLM2's does, silently): when a tool's name is not
    in the rendered prompt, the response gets ``X-Llmserve-Warning`` and the server logs it once."""
    global _tools_warning_logged
    specs = [tool.get("function") or tool for tool in tools if isinstance(tool, dict)]
    names = [spec.get("name") for spec in specs if isinstance(spec, dict)]
    missing = [name for name in names if isinstance(name, str) and name and name not in text]
    if not missing:
        return
    ctx = current_context()
    if ctx is not None and TOOLS_WARNING not in ctx.warnings:
        ctx.warnings.append(TOOLS_WARNING)
    if not _tools_warning_logged:
        _tools_warning_logged = True
        log.warning("the chat template did not render a request's tools (%d of %d missing from the prompt): the "
                    "model cannot call them; use --chat-template with a template that renders tools (responses "
                    "carry X-Llmserve-Warning; logged once)", len(missing), len(names))
