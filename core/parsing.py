"""The parser interface shared by tool-call and reasoning parser plugins.

A parser is a fresh object per request (and per choice). Streaming and non-streaming use
one code path: ``feed`` each new piece of model output, then ``finish`` once; the
non-streaming result is simply "feed everything, then finish".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call. The first piece of a call has ``id`` and the whole ``name``;
    later pieces carry only ``arguments`` fragments. ``index`` numbers calls from 0."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParseDelta:
    """What a parser releases after one ``feed`` or ``finish`` call."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """Base class of tool-call parsers, contributed through ``register_tool_parsers``.

    ``tokenizer`` is the model's tokenizer (parsers that need special-token ids look them up
    there); ``tools`` is the request's OpenAI ``tools`` list (or None).

    Example::

        class LineParser(ToolParser):
            def feed(self, text, token_ids=()):
                ...  # buffer text, release content and call pieces
            def finish(self):
                ...  # flush what is buffered
    """

    #: Whether the parser needs special tokens kept in the text (skip_special_tokens off).
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []

    @abstractmethod
    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        """Take the next piece of model output; return what can be released now."""

    @abstractmethod
    def finish(self) -> ParseDelta:
        """The output is complete: release everything still held back."""
