"""``tools`` and ``tool_choice`` of a chat request: which tools reach the chat template, how the
output becomes tool calls, and the JSON schema that forces calls.

- ``none``: tools are not offered to the template and the output is not parsed for calls.
- ``auto`` (the default when a request has tools): the server's ``--tool-call-parser`` finds
  calls in free text; it needs ``--enable-auto-tool-choice`` (vLLM's rule), else a 400.
- ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``):
  guided decoding forces the output into JSON built from the tools' parameter schemas, so any
  model, however small, returns calls that parse and validate. The output is then read by
  the parsers of ``llmserve.parsing.forced``, not by a plugin: ``required`` produces
  ``[{"name": ..., "arguments": {...}}, ...]`` and a named function just its arguments object.

This module only plans; ``llmserve.parsing.service.ParsingService.chains`` turns a plan into parsers.

``parallel_tool_calls: false`` limits the result to one call (``maxItems: 1`` when forced,
later calls dropped under ``auto``).

Parameter schemas keep their local definitions (pydantic's ``$defs``, older ``definitions``):
a named function's schema is its parameters as they are; the ``required`` array moves each
tool's definitions into the array schema's own ``$defs`` under a per-tool key
(``<tool>__<name>``) and points that tool's ``$ref``s there, so two tools may both define
``Address`` differently.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from llmserve.errors import InvalidRequestError

Mode = Literal["none", "auto", "forced"]
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing."""

    mode: Mode
    offered: list[dict[str, Any]] | None = None  # tools given to the chat template
    schema: dict[str, Any] | None = None        # forced mode: the output's JSON schema
    forced_name: str | None = None              # forced mode, named function
    parallel: bool = True


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      param=f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string",
                                      param=f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      param=f"tools.{i}.function.parameters")
        names.add(name)
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


_DEF_KEYS = ("$defs", "definitions")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")  # keys stay plain: decoders resolve a $ref by its last segment


def _pointer(segment: str) -> str:
    """A key as a JSON-pointer segment (how a ``$ref`` spells it)."""
    return segment.replace("~", "~0").replace("/", "~1")


def _rewrite_refs(node: Any, refs: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {k: _rewrite_refs(v, refs) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in refs:
            out["$ref"] = refs[ref]
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, refs) for v in node]
    return node


def _hoisted(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's parameters without its local definitions, and every tool's definitions
    together under per-tool keys, with each tool's ``$ref``s rewritten to those keys."""
    shared: dict[str, Any] = {}

    def key_for(*parts: str) -> str:
        key = "__".join(_UNSAFE.sub("_", p) for p in parts)
        base, n = key, 1
        while key in shared:
            n += 1
            key = f"{base}_{n}"
        shared[key] = None  # reserved; filled once the refs are known
        return key

    params_out = []
    for tool in tools:
        name = tool["function"]["name"]
        params = copy.deepcopy(_parameters(tool))
        refs: dict[str, str] = {}
        local: dict[str, Any] = {}
        for defs_key in _DEF_KEYS:
            defs = params.pop(defs_key, None)
            if not isinstance(defs, dict):
                continue
            for def_name, body in defs.items():
                key = key_for(name, str(def_name))
                refs[f"#/{defs_key}/{_pointer(str(def_name))}"] = f"#/$defs/{key}"
                local[key] = body
        if _uses_root_ref(params):  # a recursive schema that points at its own top
            key = key_for(name)
            refs["#"] = f"#/$defs/{key}"
            local[key] = params
        for key, body in local.items():
            shared[key] = _rewrite_refs(body, refs)
        params_out.append({"$ref": refs["#"]} if "#" in refs else _rewrite_refs(params, refs))
    return params_out, shared


def _uses_root_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == "#" or any(_uses_root_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_uses_root_ref(v) for v in node)
    return False


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, *,
               auto_enabled: bool, tool_parser: str | None, why: str = "") -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s name the field) and decide the plan.

    ``auto_enabled`` and ``tool_parser`` are the server's ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``; ``why`` (``ParsingService.why_no_auto``) goes into the 400 of an
    ``auto`` choice the server cannot serve.
    """
    parallel = parallel_tool_calls is not False
    if tools is not None:
        tools = _check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none", parallel=parallel)
    if not tools:
        raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
    if tool_choice == "auto":
        if not (auto_enabled and tool_parser):
            raise InvalidRequestError(f'"auto" tool choice requires {AUTO_FLAGS} to be set on the server{why}; '
                                      'send tool_choice "none", "required" or a named function instead',
                                      param="tool_choice")
        return ToolPlan("auto", offered=tools, parallel=parallel)
    if tool_choice == "required":
        arguments, defs = _hoisted(tools)
        branches = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                    "arguments": args},
                     "required": ["name", "arguments"]} for t, args in zip(tools, arguments)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
        if defs:
            schema["$defs"] = defs
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("forced", offered=tools, schema=schema, parallel=parallel)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        for tool in tools:
            if tool["function"]["name"] == name:
                return ToolPlan("forced", offered=tools, schema=_parameters(tool), forced_name=name,
                                parallel=parallel)
        raise InvalidRequestError(f"tool_choice names function '{name}', which is not in tools",
                                  param="tool_choice")
    raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a named function; '
                              f'got {json.dumps(tool_choice)[:80]}', param="tool_choice")

