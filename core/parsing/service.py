"""The server's parsers, resolved once at start: the tool and reasoning parser classes, whether
``auto`` tool choice is on, and what each request's chains need (``ParsingService``).

Routes read the parser settings here, never from the config: ``plan`` plans a request's tools
under the server's flags, ``chains`` gives the maker of a request's parse chains together with
the one fact the request needs from them (``needs_special_tokens``, declared by the classes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.parsing.chain import ChainMaker, ParseChain
from llmserve.parsing.contract import ReasoningParser, ToolParser
from llmserve.parsing.tool_choice import ToolPlan, plan_tools

if TYPE_CHECKING:
    from llmserve.config import ParsingConfig
    from llmserve.guided.spec import GuidedSpec
    from llmserve.parsing.detect import Detection
    from llmserve.sampling import SamplingParams


log = logging.getLogger("llmserve.parsing")

#: The parser name that asks for detection from the model's chat template (``llmserve.parsing.detect``).
AUTO = "auto"


def requested_parsers(config: "ParsingConfig") -> tuple[str | None, str | None]:
    """The tool-call and reasoning parser names the configuration asks for: as given, and
    ``auto`` for the tool parser where none is named and ``--enable-auto-tool-choice`` is not
    turned off (not given: tool calling follows the model's template, as llama.cpp and Ollama
    do); the reasoning parser is ``auto`` only when the flag is given and neither is named."""
    tool, reasoning = config.tool_call_parser, config.reasoning_parser
    if config.enable_auto_tool_choice and not tool:
        return AUTO, reasoning or AUTO
    if config.enable_auto_tool_choice is None and not tool:
        return AUTO, reasoning
    return tool, reasoning


@dataclass(frozen=True, slots=True)
class Chains:
    """A request's maker of fresh parse chains (``make()``: one per choice), or ``None`` as
    ``make`` when nothing is parsed; ``needs_special_tokens`` when a parser declared it;
    ``reasoning``: the reasoning parser class the chains run, if any (its declared markers
    end a reasoning whose thinking budget is spent)."""

    make: ChainMaker | None
    needs_special_tokens: bool = False
    reasoning: type[ReasoningParser] | None = None

    def keep_markers(self, sampling: "SamplingParams") -> "SamplingParams":
        """``sampling`` with ``skip_special_tokens`` off when a parser needs its marker tokens
        in the text (a copy; the request's own parameters are not changed)."""
        if self.needs_special_tokens and sampling.skip_special_tokens:
            return sampling.model_copy(update={"skip_special_tokens": False})
        return sampling


@dataclass(frozen=True, slots=True)
class ParsingService:
    """``--tool-call-parser``, ``--reasoning-parser`` and ``--enable-auto-tool-choice``, loaded
    once (``from_config`` fails fast on an unknown name or a parser that does not import)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    tool_cls: type[ToolParser] | None = None
    reasoning_cls: type[ReasoningParser] | None = None
    auto_tools: bool = False  # auto tool choice is on: a tool parser, and the flag not turned off
    detection: "Detection | None" = None  # what ``auto`` found in the chat template, and why

    @classmethod
    def from_config(cls, config: "ParsingConfig", registry: Any, template: Any = None,
                    special_tokens: dict[str, str] | None = None) -> "ParsingService":
        """The parsers ``config`` names; an ``auto`` one (``requested_parsers``) is detected from
        the model's chat ``template`` (``special_tokens``: its ``bos_token``... for rendering)."""
        tool, reasoning = requested_parsers(config)
        detection = None
        if AUTO in (tool, reasoning):
            from llmserve.parsing.detect import detect_parsers

            detection = detect_parsers(template, registry, special_tokens)
            tool = detection.tool.name if tool == AUTO else tool
            reasoning = detection.reasoning.name if reasoning == AUTO else reasoning
        return cls(tool, reasoning,
                   registry.load("tool_parser", tool) if tool else None,
                   registry.load("reasoning_parser", reasoning) if reasoning else None,
                   auto_tools=bool(tool) and config.enable_auto_tool_choice is not False, detection=detection)

    @classmethod
    def for_model(cls, config: "ParsingConfig", registry: Any, model: Any) -> "ParsingService":
        """``from_config`` with the loaded ``model``'s template (``ModelInfo``), the choices of
        ``auto`` logged with their evidence: one line per parser chosen, and one when no
        tool-call format was recognised (tool calls then stay off)."""
        from llmserve.text.chat_template import special_tokens

        tokenizer = getattr(model, "tokenizer", None)
        template = getattr(tokenizer, "chat_template", None) or getattr(model, "chat_template", None)
        service = cls.from_config(config, registry, template, special_tokens(tokenizer))
        tool, reasoning = requested_parsers(config)
        found = service.detection
        if found is not None and tool == AUTO:
            if found.tool.name:
                log.info("tool-call parser %s, detected: %s", found.tool.name, found.tool.evidence)
            else:
                log.info("tool calls are off: no tool-call format was recognised (%s); name a parser with "
                         "--tool-call-parser", found.tool.evidence)
        if found is not None and reasoning == AUTO and found.reasoning.name:
            log.info("reasoning parser %s, detected: %s", found.reasoning.name, found.reasoning.evidence)
        return service

    @property
    def why_no_auto(self) -> str:
        """Why ``auto`` tool choice is off, for its 400 (empty when it is on or simply not asked
        for): the detection's finding when the model's template showed no tool-call format."""
        if self.auto_tools or self.detection is None or self.detection.tool.name:
            return ""
        evidence = self.detection.tool.evidence
        return f" (the model's chat template shows no tool-call format a parser here reads: {evidence})"

    def plan(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolPlan:
        """``tools`` / ``tool_choice`` (OpenAI's shapes) planned under the server's flags."""
        return plan_tools(tools, tool_choice, parallel_tool_calls, auto_enabled=self.auto_tools,
                          tool_parser=self.tool_parser, why=self.why_no_auto)

    def forced_spec(self, plan: ToolPlan) -> "GuidedSpec":
        """A forced plan's constraint: in the tool parser's own syntax when its class declares
        one (``ToolParser.forced_calls``: kind ``structure``), else the plan's JSON schema.
        Linear in the tools: call it off the event loop."""
        from llmserve.parsing.forced_syntax import forced_spec

        return forced_spec(self.tool_cls, plan)

    def chains(self, tokenizer: Any, plan: ToolPlan | None, *, constrained: bool = False, reasoning: bool = True,
               template_kwargs: dict[str, Any] | None = None, native: bool = False) -> Chains:
        """The chains of one request. ``plan``: its tool plan (``None``: no tools are parsed,
        as for completions); ``constrained``: guided decoding shapes the output, which then has
        no thinking to separate; ``reasoning``: false when the request turned thinking off;
        ``native``: a forced plan constrained in the tool parser's own syntax (``forced_spec``),
        read by that parser rather than the forced-JSON one."""
        native = native and plan is not None and plan.mode == "forced" and self.tool_cls is not None
        forced = plan if plan is not None and plan.mode == "forced" and not native else None
        tool_cls = self.tool_cls if plan is not None and (plan.mode == "auto" or native) else None
        reasoning_cls = self.reasoning_cls if reasoning and not (constrained or forced or native) else None
        make = ParseChain.maker(tool_cls, reasoning_cls, forced, tokenizer=tokenizer,
                                tools=plan.offered if plan is not None else None,
                                chat_template_kwargs=template_kwargs)
        special = any(c is not None and c.needs_special_tokens for c in (tool_cls, reasoning_cls))
        return Chains(make, special, reasoning_cls)
