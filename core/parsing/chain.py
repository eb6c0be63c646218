"""Running a reasoning parser and a tool parser together, and assembling what they release.

``ParseChain.maker`` is the one place that turns parser classes into chains: the server's
``ParsingService`` (``llmserve.parsing.service``, loaded once at start) uses it for every
route, and ``ParseChain.factory`` for parsers named in a registry (``llmserve parse``, tests).
A route gets one maker per request and makes one chain per choice::

    chains = context.parsing.chains(tokenizer, plan, constrained=mask_factory is not None)
    sampling = chains.keep_markers(sampling)        # parsers declare needs_special_tokens
    chain = chains.make()                           # None maker: nothing to parse
    for text, ids in deltas:                        # streaming
        delta = chain.feed(text, ids)               # a ParseDelta; the route renders its dialect
    delta = chain.finish()
    finish_reason = "tool_calls" if chain.tools_called else finish_reason

Non-streaming is the same path: ``chain.parse(text)`` feeds everything, finishes and returns
the assembled ``{"content", "reasoning_content", "tool_calls"}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from llmserve.parsing.contract import ParseDelta, ReasoningParser, ToolParser
from llmserve.parsing.forced import forced_parser

if TYPE_CHECKING:
    from llmserve.parsing.tool_choice import ToolPlan


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
    def factory(cls, registry: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
                tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, plan: "ToolPlan | None" = None,
                constrained: bool = False, strict: bool = False) -> ChainMaker | None:
        """A maker of fresh chains (one per choice), or ``None`` when nothing is to be parsed.

        Parsers are named in ``registry`` (``llmserve.hooks.registry.Registry``) and loaded here,
        once: unknown names raise ``ConfigError``, an implementation that fails to import
        ``PluginLoadError`` (both one clear line). Tool parsers are built as
        ``cls(tokenizer, tools)``, reasoning parsers as ``cls(tokenizer, chat_template_kwargs)``.

        ``plan`` (a chat request's ``llmserve.parsing.tool_choice.ToolPlan``) decides the tool
        parser when given: none for ``none``, ``tool_parser`` over the offered tools for
        ``auto``, the forced-output parser (``llmserve.parsing.forced``) for ``forced``. The
        reasoning parser stays out of ``constrained`` output (guided decoding, forced calls):
        such output has no thinking to separate.
        """
        forced = plan if plan is not None and plan.mode == "forced" else None
        if plan is not None:
            tool_parser = tool_parser if plan.mode == "auto" else None
            tools = plan.offered
        tool_cls = registry.load("tool_parser", tool_parser) if tool_parser else None
        reasoning_cls = (registry.load("reasoning_parser", reasoning_parser)
                         if reasoning_parser and not (constrained or forced) else None)
        return cls.maker(tool_cls, reasoning_cls, forced, tokenizer=tokenizer, tools=tools,
                         chat_template_kwargs=chat_template_kwargs, strict=strict)

    @classmethod
    def maker(cls, tool_cls: type[ToolParser] | None, reasoning_cls: type[ReasoningParser] | None,
              forced: "ToolPlan | None" = None, *, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
              chat_template_kwargs: dict[str, Any] | None = None, strict: bool = False) -> "ChainMaker | None":
        """``factory`` from parser classes already loaded (``llmserve.parsing.service``), or
        ``None`` when there is nothing to parse. ``forced``: a forced plan, read by the
        forced-output parser instead of ``tool_cls``."""
        if tool_cls is None and reasoning_cls is None and forced is None:
            return None
        tools, template_kwargs = tools or [], chat_template_kwargs or {}

        def make() -> ParseChain:
            tool: ToolParser | None = None
            if forced is not None:
                tool = forced_parser(forced)
            elif tool_cls is not None:
                tool = tool_cls(tokenizer, tools)
            reasoning = reasoning_cls(tokenizer, template_kwargs) if reasoning_cls is not None else None
            return cls(tool, reasoning, strict=strict)
        return make

    @classmethod
    def create(cls, registry: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
               tokenizer: Any = None, tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: dict[str, Any] | None = None, strict: bool = False) -> "ParseChain":
        """One chain from ``factory`` (an empty chain, passing text through, when no parser is named)."""
        make = cls.factory(registry, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                           tokenizer=tokenizer, tools=tools, chat_template_kwargs=chat_template_kwargs,
                           strict=strict)
        return make() if make is not None else cls(strict=strict)

    @property
    def needs_special_tokens(self) -> bool:
        """Whether a parser declared that it needs special tokens kept in the text; the route
        then turns ``skip_special_tokens`` off (parsers never touch the request)."""
        return any(p is not None and p.needs_special_tokens for p in (self.tool_parser, self.reasoning_parser))

    @property
    def tools_called(self) -> bool:
        """Whether any tool call was released so far (finish_reason ``tool_calls``)."""
        return self.assembled.tools_called

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


#: What ``ParseChain.factory`` returns (when something is to be parsed): a fresh chain per call.
ChainMaker = Callable[[], ParseChain]


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
                    raise StreamContractError(
                        f"tool call {piece.index}: its first delta needs an id and the whole name")
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

