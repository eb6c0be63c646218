"""``tools`` and ``tool_choice`` of a chat request: which tools reach the chat template, how the
output becomes tool calls, and the JSON schema that forces calls.

- ``none``: tools are not offered to the template and the output is not parsed for calls.
- ``auto`` (the default when a request has tools): the server's ``--tool-call-parser`` finds
  calls in free text; it needs ``--enable-auto-tool-choice`` (vLLM's rule), else a 400.
- ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``):
  guided decoding forces the output into JSON built from the tools' parameter schemas, so any
  model, however small, returns calls that parse and validate. The output is then read by
  the parsers here, not by a plugin: ``required`` produces ``[{"name": ..., "arguments":
  {...}}, ...]`` and a named function produces just its arguments object.

``parallel_tool_calls: false`` limits the result to one call (``maxItems: 1`` when forced,
later calls dropped under ``auto``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from llmserve.errors import InvalidRequestError
from llmserve.parsing.contract import ParseDelta, ToolCallDelta, ToolParser, new_call_id

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

    def forced_parser(self) -> ToolParser:
        """The parser for forced output (``mode == "forced"``)."""
        if self.forced_name is not None:
            return NamedCallParser(self.forced_name)
        return CallArrayParser()


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


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, *,
               auto_enabled: bool, tool_parser: str | None) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s name the field) and decide the plan.

    ``auto_enabled`` and ``tool_parser`` are the server's ``--enable-auto-tool-choice`` and
    ``--tool-call-parser``.
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
            raise InvalidRequestError(f'"auto" tool choice requires {AUTO_FLAGS} to be set on the server; '
                                      'send tool_choice "none", "required" or a named function instead',
                                      param="tool_choice")
        return ToolPlan("auto", offered=tools, parallel=parallel)
    if tool_choice == "required":
        branches = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                    "arguments": _parameters(t)},
                     "required": ["name", "arguments"]} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
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


def first_call_only(delta: ParseDelta) -> ParseDelta:
    """``parallel_tool_calls: false`` under ``auto``: drop pieces of every call after the first."""
    if any(c.index > 0 for c in delta.tool_calls):
        delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
    return delta


class NamedCallParser(ToolParser):
    """Forced named function: the whole output is the arguments object of one call."""

    def __init__(self, name: str) -> None:
        super().__init__(None, [])
        self.name = name
        self.started = False

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ParseDelta()
            self.started = True
            return ParseDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, text)])
        return ParseDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])

    def finish(self) -> ParseDelta:
        if self.started:
            return ParseDelta()
        self.started = True  # nothing generated (e.g. max_tokens reached at once): an empty call
        return ParseDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, "")])


class CallArrayParser(ToolParser):
    """Forced ``required``: ``[{"name": ..., "arguments": {...}}, ...]``, streamed.

    Guided decoding makes the text valid JSON, so a character scanner that tracks strings and
    nesting is enough. Key order is free: arguments seen before the name wait for it.
    """

    def __init__(self) -> None:
        super().__init__(None, [])
        self.depth = 0
        self.in_str = self.escape = False
        self.expect_key = False
        self.key: str | None = None
        self.token: list[str] = []   # the string being read at depth 2 (a key or the name)
        self.reading: str | None = None  # "key" / "name" while inside such a string
        self.args: list[str] | None = None  # arguments text held while the name is unknown
        self.args_depth = -1          # depth at which the arguments value started
        self.in_args = False
        self.name: str | None = None
        self.index = -1
        self.started = False
        self.out = ParseDelta()

    def _start_call(self) -> None:
        self.index += 1
        self.key = self.name = None
        self.args, self.in_args, self.started = [], False, False

    def _args(self, s: str) -> None:
        if self.started:
            self.out.tool_calls.append(ToolCallDelta(self.index, arguments=s))
        else:
            assert self.args is not None
            self.args.append(s)

    def _named(self, name: str) -> None:
        self.name = name
        self.started = True
        held = "".join(self.args or [])
        self.out.tool_calls.append(ToolCallDelta(self.index, new_call_id(), name, held))
        self.args = []

    def _char(self, c: str) -> None:  # noqa: C901 - one flat scanner reads best in one place
        if self.in_args and self.depth == self.args_depth and not self.in_str and c in ",}":
            self.in_args = False  # a scalar arguments value ended
        if self.in_str:
            if self.in_args:
                self._args(c)
            if self.escape:
                self.escape = False
                self.token.append(c)
            elif c == "\\":
                self.escape = True
                self.token.append(c)
            elif c == '"':
                self.in_str = False
                if self.reading is not None:
                    text = json.loads('"' + "".join(self.token) + '"')
                    if self.reading == "key":
                        self.key = text
                    elif self.name is None:
                        self._named(text)
                    self.reading = None
            else:
                self.token.append(c)
            return
        if self.in_args:
            if c in " \t\r\n" and self.depth == self.args_depth:
                return
            self._args(c)
        if c == '"':
            self.in_str = True
            self.token = []
            if self.depth == 2 and not self.in_args:
                self.reading = "key" if self.expect_key else ("name" if self.key == "name" else None)
        elif c in "{[":
            self.depth += 1
            if self.depth == 2 and c == "{":
                self._start_call()
                self.expect_key = True
        elif c in "}]":
            self.depth -= 1
            if self.in_args and self.depth == self.args_depth:
                self.in_args = False  # an object/array arguments value closed
            if self.depth == 1 and c == "}":
                self._end_call()
        elif self.depth == 2 and not self.in_args:
            if c == ":":
                self.expect_key = False
                if self.key == "arguments":
                    self.in_args, self.args_depth = True, 2
            elif c == ",":
                self.expect_key = True

    def _end_call(self) -> None:
        if self.name is None:
            return  # not a call: guided decoding never produces this; nothing to release
        if not self.started:
            self._named(self.name)
        self.args = []

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        for c in text:
            self._char(c)
        out, self.out = self.out, ParseDelta()
        return ParseDelta().extend(out)  # merge the per-character argument pieces

    def finish(self) -> ParseDelta:
        out, self.out = self.out, ParseDelta()
        return ParseDelta().extend(out)
