"""Forced tool calls in a family's own syntax: the shared shape of ``ToolParser.forced_calls``.

A family describes one call of one tool (``call(name, parameters)``: a ``Structure`` piece, the
way its chat template writes a call); ``forced_structure`` makes the whole output of it: one of
the allowed tools (the named one, or any offered tool for ``required``), once when parallel
calls are off, else one to ``MAX_CALLS`` calls with the family's separator between them.
``forced_spec`` is what the core asks for a forced plan: the family's structure when the
server's tool parser declares one, else today's JSON schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from llmserve.errors import InvalidRequestError
from llmserve.guided.spec import GuidedSpec
from llmserve.guided.structure import Structure

if TYPE_CHECKING:
    from llmserve.parsing.contract import ToolParser
    from llmserve.parsing.tool_choice import ToolPlan

#: Most calls a forced ``required`` output with parallel calls holds (as the JSON array's
#: default length: a small model otherwise keeps adding calls until ``max_tokens``).
MAX_CALLS = 20

Piece = dict[str, Any]


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A checked tool's ``parameters`` schema (an empty object schema when it has none)."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def forced_structure(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                     call: Callable[[str, dict[str, Any]], Piece], *, separator: str = "\n",
                     prefix: str = "", suffix: str = "") -> Piece:
    """The structure of a forced output: ``prefix``, then one call of the named tool (exactly
    one), or of any offered tool when ``name`` is None, repeated up to ``MAX_CALLS`` times with
    ``separator`` between calls when ``parallel``, then ``suffix``. ``call(name, parameters)`` is one call in
    the family's syntax; it raises ``InvalidRequestError`` for a tool the syntax cannot write."""
    options = [call(t["function"]["name"], tool_parameters(t)) for t in tools
               if name is None or t["function"]["name"] == name]
    if not options:
        raise InvalidRequestError(f"tool_choice names function '{name}', which is not in tools", param="tool_choice")
    one = options[0] if len(options) == 1 else Structure.one_of(*options)
    body = Structure.repeat(one, 1, MAX_CALLS, Structure.text(separator)) if parallel and name is None else one
    return Structure.sequence(Structure.text(prefix), body, Structure.text(suffix)) if prefix or suffix else body


def forced_spec(tool_cls: "type[ToolParser] | None", plan: "ToolPlan") -> GuidedSpec:
    """The constraint of a forced plan: the structure ``tool_cls`` declares for it (kind
    ``structure``), else the plan's JSON schema. Linear in the tools; run it off the event loop."""
    structure = tool_cls.forced_calls(plan.offered or [], plan.forced_name, plan.parallel) if tool_cls else None
    if structure is None:
        return GuidedSpec("json_schema", plan.schema, param="tool_choice")
    return GuidedSpec("structure", structure, param="tool_choice")
