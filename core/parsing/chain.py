"""Running a reasoning parser and a tool parser together, and assembling what they release.

The chat route makes one ``ParseChain`` per choice::

    chain = ParseChain.create(context.registry, tool_parser=cfg.tool_call_parser,
                              reasoning_parser=cfg.reasoning_parser, tokenizer=tokenizer,
                              tools=body.tools, chat_template_kwargs=body.chat_template_kwargs)
    body = chain.adjust_request(body)               # e.g. keep special tokens
    for text, ids in deltas:                        # streaming
        message = openai_delta(chain.feed(text, ids))    # None: nothing to send yet
    message = openai_delta(chain.finish())
    finish_reason = "tool_calls" if chain.tools_called else finish_reason

Non-streaming is the same path: ``chain.parse(text)`` feeds everything, finishes and returns
the assembled ``{"content", "reasoning_content", "tool_calls"}``.
"""

from __future__ import annotations

from typing import Any

from llmserve.parsing.contract import ParseDelta, ReasoningParser, ToolParser


class ParseChain:
    """Reasoning first, then tools: the reasoning parser's ``content`` is what the tool parser
    sees, so a call is only parsed once the thinking is over. Either parser may be ``None``.

    ``feed``/``finish`` return one merged ``ParseDelta``; ``assembled`` accumulates everything
    released so far (``result()`` gives the message fields).
    """

    def __init__(self, tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None,
                 strict: bool = False) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.assembled = Assembler(strict=strict)

    @classmethod
    def create(cls, registry: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
               tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: dict[str, Any] | None = None, strict: bool = False) -> "ParseChain":
        """Build fresh parsers named in ``registry`` (``llmserve.hooks.registry.Registry``).

        Unknown names raise ``ConfigError``; an implementation that fails to import raises
        ``PluginLoadError`` (both one clear line).
        """
        tool = registry.load("tool_parser", tool_parser)(tokenizer, tools or []) if tool_parser else None
        reasoning = (registry.load("reasoning_parser", reasoning_parser)(tokenizer, chat_template_kwargs or {})
                     if reasoning_parser else None)
        return cls(tool, reasoning, strict=strict)

    @property
    def needs_special_tokens(self) -> bool:
        return any(p is not None and p.needs_special_tokens for p in (self.tool_parser, self.reasoning_parser))

    @property
    def tools_called(self) -> bool:
        """Whether any tool call was released so far (finish_reason ``tool_calls``)."""
        return self.assembled.tools_called

    def adjust_request(self, request: Any) -> Any:
        """Let both parsers adjust the request before generation."""
        for parser in (self.reasoning_parser, self.tool_parser):
            if parser is not None:
                request = parser.adjust_request(request)
        return request

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        """The next piece of model output (and its token ids); returns what can be sent now."""
        if self.reasoning_parser is not None:
            first = self.reasoning_parser.feed(text, token_ids)
            # Token ids only line up with the text when the reasoning parser passed it all on.
            ids = token_ids if first.content == text else ()
        else:
            first, ids = ParseDelta(content=text), token_ids
        return self._on(first, ids, final=False)

    def finish(self) -> ParseDelta:
        """The output is complete: release everything."""
        first = self.reasoning_parser.finish() if self.reasoning_parser is not None else ParseDelta()
        return self._on(first, (), final=True)

    def parse(self, text: str) -> dict[str, Any]:
        """Non-streaming: feed ``text`` whole, finish, and return the assembled result."""
        self.feed(text)
        self.finish()
        return self.result()

    def result(self) -> dict[str, Any]:
        return self.assembled.result()

    def _on(self, first: ParseDelta, ids: Any, final: bool) -> ParseDelta:
        out = ParseDelta(reasoning=first.reasoning)
        if self.tool_parser is None:
            out.content = first.content
        else:
            if first.content:
                out.extend(self.tool_parser.feed(first.content, ids))
            if final:
                out.extend(self.tool_parser.finish())
        self.assembled.add(out)
        return out


class StreamContractError(ValueError):
    """A parser released deltas that break the streaming contract (``strict`` mode)."""


class Assembler:
    """Accumulates ``ParseDelta``s into ``{"content", "reasoning_content", "tool_calls"}``.

    ``content``/``reasoning_content`` are ``None`` when empty; ``tool_calls`` is ``[]`` when
    none, else ``[{"id", "type": "function", "function": {"name", "arguments"}}]``. With
    ``strict=True`` a delta that breaks the streaming contract (a call's first piece without
    id or name, a later piece with them, indices out of order) raises ``StreamContractError``.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def add(self, delta: ParseDelta) -> None:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            if piece.index == len(self.calls):
                if self.strict and (not piece.id or not piece.name):
                    raise StreamContractError(f"tool call {piece.index}: its first delta needs an id and the whole name")
                self.calls.append({"id": piece.id or "", "type": "function",
                                   "function": {"name": piece.name or "", "arguments": piece.arguments}})
            elif 0 <= piece.index < len(self.calls):
                if self.strict and (piece.id is not None or piece.name is not None):
                    raise StreamContractError(f"tool call {piece.index}: only its first delta may carry id and name")
                self.calls[piece.index]["function"]["arguments"] += piece.arguments
            elif self.strict:
                raise StreamContractError(f"tool call index {piece.index} out of order (have {len(self.calls)})")
            else:  # tolerate a parser that skips an index: treat the piece as a new call
                self.calls.append({"id": piece.id or "", "type": "function",
                                   "function": {"name": piece.name or "", "arguments": piece.arguments}})

    def result(self) -> dict[str, Any]:
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        return {"content": content or None, "reasoning_content": reasoning or None,
                "tool_calls": [{**c, "function": dict(c["function"])} for c in self.calls]}


def openai_delta(delta: ParseDelta, reasoning_key: str = "reasoning_content") -> dict[str, Any] | None:
    """A ``ParseDelta`` as the ``delta`` object of an OpenAI chat chunk; ``None`` when empty.

    A call's first piece becomes ``{"index", "id", "type": "function", "function": {"name",
    "arguments"}}``, later pieces ``{"index", "function": {"arguments"}}``.
    """
    if delta.is_empty():
        return None
    out: dict[str, Any] = {}
    if delta.reasoning:
        out[reasoning_key] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for c in delta.tool_calls:
            if c.name is not None:
                calls.append({"index": c.index, "id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
            else:
                calls.append({"index": c.index, "function": {"arguments": c.arguments}})
        out["tool_calls"] = calls
    return out
