"""Forced calls in the JSON-call syntaxes, as a structure for guided decoding (``ToolParser.forced_calls``).

A call is a head that names the function, its arguments as one compact JSON object valid under
the tool's schema, and a tail; the calls stand between a prefix and a suffix, a separator
between two. That is hermes' ``<tool_call>`` blocks, the JSON lists of granite, jamba,
phi4_mini_json and mistral, llama3_json's ``;``-joined objects and the special-token sections
of kimi_k2 and deepseek. ``JsonLayout`` declares a family's shape; ``ForcedJson`` gives a parser
the ``forced_calls`` of its ``layout``.

The name is written as a JSON string (escaped) inside a JSON call object, else bare, and then
only when the family's reader takes it back (``bare``); a name the syntax cannot write is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from llmserve import InvalidRequestError
from llmserve import Structure, forced_structure

Piece = dict[str, Any]
#: Literal text, or a tuple of texts and structure pieces (what may vary there: a call index).
Parts = str | tuple[str | Piece, ...]


def _pieces(parts: Parts, name: str | None = None) -> list[Piece]:
    out = []
    for part in (parts,) if isinstance(parts, str) else parts:
        if isinstance(part, str):
            text = part.replace("{}", name) if name is not None else part
            if text:
                out.append(Structure.text(text))
        else:
            out.append(part)
    return out


@dataclass(frozen=True)
class JsonLayout:
    """How a family's template writes calls: ``head`` (``{}`` stands for the name), the
    arguments, ``tail``; ``separator`` between two calls, all of them between ``prefix`` and
    ``suffix``. ``words`` are the markers the arguments may not hold (the reader would stop at
    them). ``bare``: whether the reader takes a name back written as is; None writes it as a
    JSON string."""

    head: Parts
    tail: Parts = ""
    prefix: Parts = ""
    separator: str = ""
    suffix: Parts = ""
    words: tuple[str, ...] = ()
    bare: Callable[[str], Any] | None = None

    def _name(self, function: str) -> str:
        written = json.dumps(function, ensure_ascii=False) if self.bare is None else function
        if (self.bare is not None and not self.bare(function)) or any(w in written for w in self.words):
            raise InvalidRequestError(f"tool_choice: the function name {function[:60]!r} cannot be written in the "
                                      "model's tool-call syntax (its parser would not read it back)",
                                      param="tool_choice")
        return written

    def call(self, function: str, parameters: dict[str, Any]) -> Piece:
        """One call to ``function`` with the tool's ``parameters`` schema."""
        return Structure.sequence(*_pieces(self.head, self._name(function)),
                                  Structure.json(parameters, without=self.words), *_pieces(self.tail))

    def forced(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> Piece:
        """The whole forced output (``forced_structure``'s rules) in this layout."""
        body = forced_structure(tools, name, parallel, self.call, separator=self.separator)
        ends = _pieces(self.prefix), _pieces(self.suffix)
        return Structure.sequence(*ends[0], body, *ends[1]) if ends[0] or ends[1] else body


def object_layout(before: str = "", after: str = "", key: str = "arguments", **options: Any) -> JsonLayout:
    """The layout of calls written as JSON objects, ``{"name": "NAME", "arguments": {...}}`` spaced
    as the templates' ``tojson`` writes it (``key``: the arguments' key), each with ``before`` and
    ``after`` around it; ``options``: the other fields of ``JsonLayout``."""
    return JsonLayout(before + '{"name": {}, "' + key + '": ', "}" + after, **options)


class ForcedJson:
    """Mixin of a tool parser (listed before its parser base): forced calls follow ``layout``."""

    layout: ClassVar[JsonLayout]

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        return cls.layout.forced(tools, name, parallel)
