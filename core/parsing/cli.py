"""``llmserve parse``: run tool-call / reasoning parsers on one model output read from stdin.

Kept out of ``llmserve.cli`` so the CLI stays import-light; no tokenizer is loaded (the
built-in parsers work on text alone), so neither torch nor transformers is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmserve.errors import ConfigError


def load_tools(path: Path | None) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` list in ``path`` (a JSON list, or an object with a ``tools`` key)."""
    if path is None:
        return []
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read --tools {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        data = data["tools"]
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise ConfigError(f"--tools {path}: expected a JSON list of tool objects")
    return data


def parse_output(text: str, registry: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 chunk: int = 0) -> dict[str, Any]:
    """Parse ``text`` whole (``chunk`` 0) or fed in ``chunk``-character pieces through the
    streaming path; returns ``{"content", "reasoning_content", "tool_calls"}``.

    Raises ``ConfigError`` for unknown parsers and ``StreamContractError`` when a parser
    breaks the streaming contract (checked strictly here).
    """
    from llmserve.parsing.chain import ParseChain

    for kind, name in (("tool_parser", tool_parser), ("reasoning_parser", reasoning_parser)):
        if name:
            registry.get(kind, name)
    chain = ParseChain.create(registry, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                              tools=tools, chat_template_kwargs=chat_template_kwargs, strict=True)
    if chunk <= 0:
        return chain.parse(text)
    for start in range(0, len(text), chunk):
        chain.feed(text[start:start + chunk])
    chain.finish()
    return chain.result()


def detect_output(model: str, registry: Any) -> list[str]:
    """``llmserve parse --detect MODEL``: the parsers ``auto`` picks from the chat template of
    ``model`` (a model directory, a ``.gguf`` or a template file) with the evidence, one line
    per kind. ``ConfigError`` when the model cannot be read."""
    from llmserve.parsing.detect import detect_parsers
    from llmserve.text.model_template import read_model_template

    template, special_tokens = read_model_template(model)
    return detect_parsers(template, registry, special_tokens).lines()
