"""Choosing the tool-call and reasoning parsers from a model's chat template: ``--tool-call-parser
auto``, ``--reasoning-parser auto`` and ``llmserve parse --detect``.

The evidence comes from what the parsers' registrations declare, so a parser from a plugin is
detected like a built-in one and the core names none:

- **markers**: each ``ToolParserSpec`` / ``ReasoningParserSpec`` lists ``template_markers``,
  strings that all occur in the template of a model writing its format. Of the parsers whose
  markers all occur, the most specific wins: the most markers, then the most marker
  characters, then the name, so the choice never depends on the order plugins loaded in.
- **a probe** (tool parsers): the template renders a short conversation whose assistant turn
  calls one tool, and the text it wrote for that turn is fed to the candidates: the most
  specific one that reads the call back is chosen. A template that renders the turn but none
  of the candidates reads it back is taken as unknown; one that will not render the probe at
  all is judged by its markers alone.

Nothing here trusts the template: it is size-checked, rendered in the capped sandbox under a
short deadline, and any failure of a template or of a parser counts as "no evidence".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("llmserve.parsing")

#: Templates longer than this are not inspected (real ones are a few to some tens of kB).
MAX_TEMPLATE_CHARS = 1 << 20
#: Seconds the probe conversation may take to render.
PROBE_TIMEOUT = 2.0
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}]
_PROBE_ARGS = {"city": "Paris"}
_PROBE_USER = {"role": "user", "content": "What is the weather in Paris?"}
_SHOWN = 160  # characters of the probe's rendered turn quoted in the evidence
# What a template or a parser may raise on input it was not written for (jinja's errors are
# TemplateError or Python's own: a template nested too deep to compile is a SyntaxError; the
# sandbox's caps are TemplateTooCostly).
_FAILURES: tuple[type[BaseException], ...] = (ArithmeticError, AssertionError, AttributeError, LookupError,
                                              RuntimeError, SyntaxError, TypeError, ValueError)


@dataclass(frozen=True, slots=True)
class Choice:
    """One detected parser: its registered ``name`` (``None``: no format recognised) and the
    ``evidence`` for the choice, or for finding none, in words."""

    name: str | None
    evidence: str


@dataclass(frozen=True, slots=True)
class Detection:
    """The tool-call and the reasoning parser a template points at."""

    tool: Choice
    reasoning: Choice

    def lines(self) -> list[str]:
        """One line per kind, as the server logs and ``llmserve parse --detect`` prints them."""
        return [f"tool-call parser: {self.tool.name or 'none'} ({self.tool.evidence})",
                f"reasoning parser: {self.reasoning.name or 'none'} ({self.reasoning.evidence})"]

    def as_json(self) -> dict[str, Any]:
        return {"tool_call_parser": self.tool.name, "tool_call_evidence": self.tool.evidence,
                "reasoning_parser": self.reasoning.name, "reasoning_evidence": self.reasoning.evidence}


def template_text(template: Any) -> str | None:
    """The one template a model renders chats with: the text itself, or from the named
    templates some tokenizers carry (a dict, or a list of ``{"name", "template"}``) the
    ``tool_use`` one, else ``default``, else the first; ``None`` for anything else."""
    if isinstance(template, str):
        return template
    named: dict[str, Any] = {}
    if isinstance(template, dict):
        named = dict(template)
    elif isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
    for key in ("tool_use", "default", *named):
        if isinstance(named.get(key), str):
            return str(named[key])
    return None


def ranked(template: str, registry: Any, kind: str) -> list[tuple[str, tuple[str, ...]]]:
    """The registered parsers of ``kind`` whose declared markers all occur in ``template``, most
    specific first, each with its markers."""
    fits = []
    for name in registry.names(kind):
        markers = tuple(m for m in getattr(registry.get(kind, name).record, "template_markers", ()) or ()
                        if isinstance(m, str) and m)
        if markers and all(m in template for m in markers):
            fits.append((name, markers))
    return sorted(fits, key=lambda fit: (-len(fit[1]), -sum(len(m) for m in fit[1]), fit[0]))


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def probe_turns(template: str, special_tokens: dict[str, str] | None = None) -> list[str]:
    """What ``template`` writes for an assistant turn that calls ``get_weather(city="Paris")``:
    the text after what it renders for the conversation before that turn (with the assistant's
    header, as cut against the conversation alone, and without it, as cut against its
    generation prompt), for each way of passing the call it renders (arguments as an object,
    as the server passes them, or as a JSON string; content empty or null). ``[]`` when it
    renders none."""
    from jinja2 import TemplateError

    from llmserve.text.chat_template import TemplateRaised, TemplateTooCostly, render_template

    failures: tuple[type[BaseException], ...] = (TemplateError, TemplateRaised, TemplateTooCostly, *_FAILURES)
    base: dict[str, Any] = {"bos_token": "", "eos_token": ""}  # templates that add them need them defined
    base.update((k, v) for k, v in (special_tokens or {}).items() if isinstance(k, str) and isinstance(v, str))
    base.update(tools=_PROBE_TOOLS, documents=None)
    try:
        before = [render_template(template, {**base, "messages": [_PROBE_USER], "add_generation_prompt": prompt},
                                  PROBE_TIMEOUT) for prompt in (False, True)]
    except failures:  # the template does not render the conversation before the call
        return []
    turns: list[str] = []
    for arguments in (_PROBE_ARGS, json.dumps(_PROBE_ARGS)):
        for content in ("", None):
            call = {"id": "call0a1b2", "type": "function",  # 9 letters and digits: Mistral's templates check
                    "function": {"name": "get_weather", "arguments": arguments}}
            turn = {"role": "assistant", "content": content, "tool_calls": [call]}
            try:
                whole = render_template(template, {**base, "messages": [_PROBE_USER, turn],
                                                   "add_generation_prompt": False}, PROBE_TIMEOUT)
            except failures:  # the template does not render the call this way
                continue
            for prefix in before:
                cut = whole[_common_prefix(prefix, whole):]
                if cut not in turns:
                    turns.append(cut)
    return turns


def reads_back(cls: Any, text: str) -> bool:
    """Whether a tool parser of class ``cls`` finds exactly the probe's call in ``text``."""
    from llmserve.parsing.chain import ParseChain

    try:
        result = ParseChain(cls(None, _PROBE_TOOLS)).parse(text)
        calls = result["tool_calls"]
        return (len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
                and json.loads(calls[0]["function"]["arguments"]) == _PROBE_ARGS)
    except _FAILURES:  # a parser that fails on the probe does not read it
        return False


def _markers(markers: tuple[str, ...]) -> str:
    return ", ".join(json.dumps(m, ensure_ascii=False) for m in markers)


def _quoted(turn: str) -> str:
    return json.dumps(turn[:_SHOWN] + ("..." if len(turn) > _SHOWN else ""), ensure_ascii=False)


def _tool_choice(template: str, registry: Any, special_tokens: dict[str, str] | None) -> Choice:
    from llmserve.errors import PluginLoadError

    fits = ranked(template, registry, "tool_parser")
    if not fits:
        return Choice(None, "no tool-call parser's markers occur in the chat template")
    turns = [turn for turn in probe_turns(template, special_tokens) if "get_weather" in turn]
    if not turns:  # the template renders no past call (or nothing at all): the markers decide
        name, markers = fits[0]
        return Choice(name, f"markers {_markers(markers)} in the chat template, which renders no probe call")
    for name, markers in fits:
        try:
            cls = registry.load("tool_parser", name)
        except PluginLoadError:  # a parser that does not import is skipped here
            continue
        for turn in turns:
            if reads_back(cls, turn):
                return Choice(name, f"markers {_markers(markers)} in the chat template; it renders a call as "
                                    f"{_quoted(turn)}, which {name} reads back")
    names = ", ".join(name for name, _ in fits)
    return Choice(None, f"markers of {names} occur in the chat template, but none of them reads back the call it "
                        f"renders ({_quoted(turns[0])})")


def _reasoning_choice(template: str, registry: Any) -> Choice:
    fits = ranked(template, registry, "reasoning_parser")
    if not fits:
        return Choice(None, "no reasoning parser's markers occur in the chat template")
    name, markers = fits[0]
    return Choice(name, f"markers {_markers(markers)} in the chat template")


def detect_parsers(template: Any, registry: Any, special_tokens: dict[str, str] | None = None) -> Detection:
    """The parsers ``template`` (a model's chat template: text, or its named templates) points
    at among those in ``registry``; ``special_tokens`` (``bos_token``, ...) are passed to the
    probe rendering. Never raises for what the template holds."""
    text = template_text(template)
    if not text:
        none = "the model has no chat template"
        return Detection(Choice(None, none), Choice(None, none))
    if len(text) > MAX_TEMPLATE_CHARS:
        big = f"the chat template is over {MAX_TEMPLATE_CHARS} characters and was not inspected"
        return Detection(Choice(None, big), Choice(None, big))
    return Detection(_tool_choice(text, registry, special_tokens), _reasoning_choice(text, registry))
