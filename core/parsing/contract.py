"""The parser interface shared by tool-call and reasoning parser plugins.

A parser is a fresh object per request (and per choice), so all streaming state lives on the
instance and nothing is shared between requests. Streaming and non-streaming use one code
path: ``feed`` each new piece of model output, then ``finish`` once; the non-streaming result
is simply "feed everything, then finish". A parser must give the same assembled result
whatever the chunking (whole output, one character or one token at a time, any pieces).

``llmserve.parsing.chain`` runs a reasoning parser and a tool parser one after the other and
assembles their deltas into the OpenAI message shape.
"""

from __future__ import annotations

import random
import string
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
    """What a parser releases after one ``feed`` or ``finish`` call.

    ``content`` is answer text, ``reasoning`` thinking text (reasoning parsers only) and
    ``tool_calls`` pieces of calls in order. An empty delta means "nothing to send yet".
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when there is nothing to send."""
        return not (self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "ParseDelta") -> "ParseDelta":
        """Append ``other`` to this delta in place (argument pieces of one call are merged)."""
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None and call.name is None:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))
        return self


_ALNUM = string.ascii_letters + string.digits
_ids: random.Random = random.SystemRandom()


def seed_call_ids(seed: int | None) -> None:
    """Make tool-call ids deterministic (tests only); ``None`` goes back to system randomness."""
    global _ids
    _ids = random.SystemRandom() if seed is None else random.Random(seed)


def new_call_id(length: int = 24, prefix: str = "call_") -> str:
    """A fresh tool-call id: ``prefix`` + ``length`` random letters and digits.

    The default is OpenAI's ``call_`` + 24 characters; Mistral models want 9 characters and no
    prefix (``new_call_id(9, "")``).
    """
    return prefix + "".join(_ids.choice(_ALNUM) for _ in range(length))


class ToolParser(ABC):
    """Base class of tool-call parsers, contributed through ``register_tool_parsers``.

    The server builds one instance per request and per choice as ``cls(tokenizer, tools)``:
    ``tokenizer`` is the model's tokenizer or ``None`` (``llmserve parse`` has none, so parsers
    should work on text alone); ``tools`` is the request's OpenAI ``tools`` list (``[]`` when
    absent), and ``tool_names`` the set of function names in it.

    ``feed(text, token_ids)`` takes the next piece of model output (and its token ids, which
    may be empty) and returns what can be released now as a ``ParseDelta``: ``content`` and
    ``tool_calls`` pieces. Text that might still turn out to be part of a call (a partial
    ``<tool_call>``) is held back. ``finish()`` is called once at the end and releases
    everything still held, closing or giving up on unfinished calls. Rules:

    - the first ``ToolCallDelta`` of a call has ``index`` (0, 1, ... in order), ``id`` and the
      whole ``name``; later ones only ``arguments`` fragments;
    - per call, the fragments concatenate to the final ``arguments``, a JSON string;
    - the assembled result must not depend on how the output was cut into pieces;
    - markers never reach ``content``; output the parser cannot use goes to ``content``.

    Example::

        class LineParser(ToolParser):
            def feed(self, text, token_ids=()):
                ...  # buffer text, release content and call pieces
            def finish(self):
                ...  # flush what is buffered
    """

    #: Whether the parser needs special tokens kept in the text, so that markers such as
    #: ``[TOOL_CALLS]`` survive detokenization. A declared need: parsers never see the request;
    #: a class attribute, read once at start (``ParsingService``); the core then turns
    #: ``skip_special_tokens`` off for the requests this parser reads.
    needs_special_tokens: bool = False

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        """How to force calls in this family's own syntax, or None (the default): forced calls
        are then JSON, read by ``llmserve.parsing.forced``.

        ``tool_choice`` ``required`` (``name`` None: any of ``tools``, at least one call) or a
        named function (``name``: one call of it) make the core ask the server's tool parser
        class for a structure (``llmserve.Structure``: literal text, JSON values under a schema,
        free text without given strings, alternatives, repetition) that guided decoding then
        enforces; the output is read by this same parser, so it must parse every text the
        structure allows into calls of the offered tools with arguments valid under their
        schemas. ``parallel`` false: exactly one call. ``tools`` are checked OpenAI function
        tools; ``llmserve.forced_structure`` builds the common shape. Raise
        ``InvalidRequestError`` (``param="tool_choice"``) for tools the syntax cannot write.
        """
        return None

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []
        self.tool_names = {t.get("function", {}).get("name") for t in self.tools if isinstance(t, dict)} - {None}

    @abstractmethod
    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        """Take the next piece of model output; return what can be released now."""

    @abstractmethod
    def finish(self) -> ParseDelta:
        """The output is complete: release everything still held back."""


class ReasoningParser(ABC):
    """Base class of reasoning parsers, contributed through ``register_reasoning_parsers``.

    Built once per request and per choice as ``cls(tokenizer, chat_template_kwargs)``
    (``chat_template_kwargs`` is the request's dict or ``{}``; qwen3 reads
    ``enable_thinking``). ``feed``/``finish`` work like ``ToolParser``'s but release
    ``reasoning`` (the thinking text, tags removed) and ``content`` (the answer). When a
    tool parser is also configured, the content is fed on to it (see
    ``llmserve.parsing.chain.ParseChain``), so a call written after the thinking is parsed.
    """

    #: Like ``ToolParser.needs_special_tokens``.
    needs_special_tokens: bool = False
    #: The text that closes the model's reasoning, in the model's own way (``</think>``): a
    #: declared fact of the format, read once from the class. The engine writes it (as the
    #: tokenizer encodes it) to end a reasoning that reached the request's thinking budget,
    #: so a parser that declares it gets enforced budgets with no code of its own; ``None``
    #: (the default) means budgets are not enforced under this parser. It must be text the
    #: parser itself takes as the end of the reasoning.
    end_marker: str | None = None
    #: The text that opens the reasoning (``<think>``), when the format has one: a rendered
    #: prompt that ends with it opened the reasoning already (budgets count from the first
    #: generated token); otherwise they count from where the model writes it at the start of
    #: its output. ``None``: the reasoning is taken as open from the first generated token.
    start_marker: str | None = None

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @abstractmethod
    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        """Take the next piece of model output; return the reasoning and content released now."""

    @abstractmethod
    def finish(self) -> ParseDelta:
        """The output is complete: release everything still held back."""
