"""Helpers for the parser tests: run a parser chain whole or in pieces, compare structure."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from llmserve.parsing.chain import ParseChain
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry

_REGISTRY: Registry | None = None


def registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry.collect(PluginManager().load(autoload=False))
    return _REGISTRY


@dataclass
class Case:
    """One model output and what it must parse to (``calls``: ``(name, arguments)`` pairs)."""

    id: str
    text: str
    content: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    reasoning: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None

    @property
    def expected(self) -> dict[str, Any]:
        return {"content": self.content, "reasoning_content": self.reasoning, "tool_calls": list(self.calls)}


def verbatim(id: str, text: str, **fields: Any) -> Case:
    """A case whose output makes no call: all of it is content, exactly as written."""
    return Case(id, text, content=text, **fields)


def chain(case: Case) -> ParseChain:
    return ParseChain.create(registry(), tool_parser=case.tool_parser, reasoning_parser=case.reasoning_parser,
                             tools=case.tools, chat_template_kwargs=case.template_kwargs, strict=True)


def structure(result: dict[str, Any]) -> dict[str, Any]:
    """The assembled result without random ids; checks the id/type shape on the way."""
    calls = []
    for call in result["tool_calls"]:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function", call
        assert isinstance(call["id"], str) and call["id"], call
        assert set(call["function"]) == {"name", "arguments"}, call
        calls.append((call["function"]["name"], call["function"]["arguments"]))
    return {"content": result["content"], "reasoning_content": result["reasoning_content"], "tool_calls": calls}


def whole(case: Case) -> dict[str, Any]:
    """Non-streaming: feed everything, then finish."""
    return structure(chain(case).parse(case.text))


def pieces(case: Case, parts: list[str], token_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Streaming: feed ``parts`` one by one (deltas checked strictly), then finish."""
    c = chain(case)
    for i, part in enumerate(parts):
        c.feed(part, token_ids[i] if token_ids else ())
    c.finish()
    return structure(c.result())


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def random_chunks(text: str, seed: int) -> list[str]:
    """Random piece sizes 1..12, with empty pieces sprinkled in."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        if rng.random() < 0.1:
            out.append("")
        size = rng.randint(1, 12)
        out.append(text[i:i + size])
        i += size
    return out


def check_arguments(result: dict[str, Any]) -> None:
    """Every arguments string is valid JSON (strict: no NaN/Infinity, no raw control characters)."""
    for _name, arguments in result["tool_calls"]:
        json.loads(arguments, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
