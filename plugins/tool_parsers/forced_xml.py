"""Forced calls in the XML-style syntaxes (``<function=NAME><parameter=K>V</parameter></function>``
and its relatives: MiniMax's ``<invoke name=...>``, GLM's ``<arg_key>``/``<arg_value>`` pairs), as
a structure for guided decoding (``ToolParser.forced_calls``).

Each parameter is written in the order of the schema's ``properties``: the required ones always,
the others or not. A value is typed as ``xml_params.typed_value`` reads it back:

- declared ``string`` (alone or among other types) or no type at all: free text that never
  holds the family's markers (the closing ``</parameter>``, the block's tags), within the
  schema's ``minLength``/``maxLength``; a string ``enum``/``const`` is one of its values;
- any other type: compact JSON valid under the parameter's schema (the tool's ``$defs`` kept,
  so local ``$ref``s resolve).

Names the reader would not take back (empty, holding whitespace or ``<``/``>``) cannot be
written: such a required parameter, or such a function, is a 400; an optional one is left out.
"""

from __future__ import annotations

from typing import Any

from llmserve import InvalidRequestError
from llmserve import Structure, forced_structure
from llmserve.plugins.tool_parsers.xml_params import declared_types, plain_name, resolve

_DEF_KEYS = ("$defs", "definitions")


def _unwritable(what: str, name: str) -> InvalidRequestError:
    return InvalidRequestError(f"tool_choice: the {what} name {name[:60]!r} cannot be written in the model's tool-call "
                               "syntax (it is empty or holds whitespace, '<' or '>')", param="tool_choice")


def _value(schema: Any, root: dict[str, Any], words: tuple[str, ...]) -> dict[str, Any]:
    types = declared_types(schema, root)
    if not types or "string" in types:
        plain = resolve(schema, root)
        plain = plain if isinstance(plain, dict) else {}
        choices = plain.get("enum", [plain["const"]] if "const" in plain else None)
        if types == {"string"} and isinstance(choices, list) and choices and all(
                isinstance(c, str) and not any(w in c for w in words) for c in choices):
            return Structure.one_of(*(Structure.text(c) for c in choices))
        low, high = plain.get("minLength", 0), plain.get("maxLength")  # the value is always a string
        low = low if isinstance(low, int) and not isinstance(low, bool) and low >= 0 else 0
        high = high if isinstance(high, int) and not isinstance(high, bool) and high >= max(low, 1) else None
        return Structure.free_text(words, min_length=low, max_length=high)
    sub = dict(schema) if isinstance(schema, dict) else {}
    for key in _DEF_KEYS:
        if isinstance(root.get(key), dict) and key not in sub:
            sub[key] = root[key]
    return Structure.json(sub, without=words)


def xml_call(function: str, parameters: dict[str, Any], *, head: str, param: tuple[str, str], tail: str,
             words: tuple[str, ...]) -> dict[str, Any]:
    """One call as the family's template writes it: ``head`` opens the call and ``tail`` closes
    it, ``param`` is the text before and after each value; ``{}`` in ``head`` and in ``param[0]``
    stands for the function's and the parameter's name (Qwen3-Coder: ``"<function={}>\\n"``,
    ``("<parameter={}>\\n", "\\n</parameter>\\n")``, ``"</function>\\n"``). ``words`` are the markers
    a value may not hold."""
    if plain_name(function) != function:
        raise _unwritable("function", function)
    props = parameters.get("properties")
    props = props if isinstance(props, dict) else {}
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    pieces = [Structure.text(head.replace("{}", function))]
    for key, schema in props.items():
        if plain_name(key) != key:
            if key in required:
                raise _unwritable("parameter", key)
            continue
        one = Structure.sequence(Structure.text(param[0].replace("{}", key)), _value(schema, parameters, words),
                                 Structure.text(param[1]))
        pieces.append(one if key in required else Structure.one_of(one, Structure.text("")))
    missing = sorted(required - set(props))
    if missing:
        raise InvalidRequestError(f"tool_choice: {function}: required parameters {missing[:5]} are not in "
                                  "properties", param="tool_choice")
    if tail:
        pieces.append(Structure.text(tail))
    return Structure.sequence(*pieces)


def xml_block_calls(tools: list[dict[str, Any]], name: str | None, parallel: bool, *, opener: str, closer: str,
                    layout: dict[str, Any], words: tuple[str, ...]) -> dict[str, Any] | None:
    """``ToolParser.forced_calls`` of an XML-style family: one ``opener``...``closer`` block per
    call, each call as ``xml_call`` writes it with the family's ``layout`` (head, param, tail)."""
    def call(function: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return Structure.sequence(Structure.text(opener), xml_call(function, parameters, **layout, words=words),
                                  Structure.text(closer))
    return forced_structure(tools, name, parallel, call)
