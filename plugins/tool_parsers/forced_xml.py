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

from dataclasses import dataclass
from typing import Any, ClassVar

from llmserve import InvalidRequestError
from llmserve import Structure, forced_structure
from llmserve.plugins.tool_parsers.xml_params import XmlToolParser, declared_types, plain_name, resolve

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


@dataclass(frozen=True)
class XmlLayout:
    """How a family's template writes a call: ``head`` opens it and ``tail`` closes it, ``param``
    is the text before and after each value, and ``{}`` in ``head`` and in ``param[0]`` stands for
    the function's and the parameter's name (Qwen3-Coder: ``"<function={}>\\n"``,
    ``("<parameter={}>\\n", "\\n</parameter>\\n")``, ``"</function>\\n"``); each call sits in its
    own ``opener``...``closer`` block; ``words`` are the markers a value may not hold."""

    opener: str
    closer: str
    head: str
    param: tuple[str, str]
    tail: str
    words: tuple[str, ...]

    def call(self, function: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """One call to ``function`` with the tool's ``parameters`` schema, block included."""
        if plain_name(function) != function:
            raise _unwritable("function", function)
        props = parameters.get("properties")
        props = props if isinstance(props, dict) else {}
        required = parameters.get("required")
        required = set(required) if isinstance(required, list) else set()
        pieces = [Structure.text(self.opener + self.head.replace("{}", function))]
        for key, schema in props.items():
            if plain_name(key) != key:
                if key in required:
                    raise _unwritable("parameter", key)
                continue
            one = Structure.sequence(Structure.text(self.param[0].replace("{}", key)),
                                     _value(schema, parameters, self.words), Structure.text(self.param[1]))
            pieces.append(one if key in required else Structure.one_of(one, Structure.text("")))
        missing = sorted(required - set(props))
        if missing:
            raise InvalidRequestError(f"tool_choice: {function}: required parameters {missing[:5]} are not in "
                                      "properties", param="tool_choice")
        pieces.append(Structure.text(self.tail + self.closer))
        return Structure.sequence(*pieces)


class XmlFamilyParser(XmlToolParser):
    """An XML-style family: ``read_region`` reads its calls back and ``layout`` says how its
    template writes them, which forced calls follow (one block per call)."""

    layout: ClassVar[XmlLayout]

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        return forced_structure(tools, name, parallel, cls.layout.call)
