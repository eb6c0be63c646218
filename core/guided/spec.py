"""What an output must look like, in no dialect's words: ``GuidedSpec``, its shape checks, and
the two helpers several dialects share (a JSON schema given as an object or a string; one
constraint among a request's fields).

A dialect's own spellings (vLLM's ``guided_json`` and ``structured_outputs``, OpenAI's
``response_format``, TGI's ``grammar``, ...) are read by that dialect, which hands the core a
``GuidedSpec``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from llmserve.errors import InvalidRequestError
from llmserve.request import LogitsMask

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structure")

MaskFactory = Callable[[], LogitsMask]


@dataclass(slots=True, frozen=True)
class GuidedSpec:
    """What the output must look like, independent of the dialect that asked for it.

    ``kind`` and ``value``:

    - ``"json_schema"``: ``value`` is the JSON schema (a dict); the output is one JSON value
      valid under it.
    - ``"json_object"``: ``value`` is ignored (``None``); the output is any JSON object.
    - ``"regex"``: ``value`` is a regular expression the whole output must match.
    - ``"choice"``: ``value`` is a non-empty list of strings; the output is exactly one of them.
    - ``"grammar"``: ``value`` is a grammar text (e.g. EBNF / GBNF / Lark; the decoder decides
      which dialects it accepts).
    - ``"structure"``: ``value`` is a structure of pieces (literal text, JSON values under a
      schema, free text without given strings, alternatives, repetition) built with
      ``llmserve.guided.structure.Structure``; forced tool calls in a family's own syntax.

    ``param`` names the request field the constraint came from (``"guided_json"``,
    ``"response_format"``, ...); decoders put it in the ``InvalidRequestError`` they raise so
    the client learns which field is wrong. It is not part of the cache key.

    ``compact`` (the default; it matters for the JSON kinds) asks for compact JSON: no
    whitespace outside strings and no run of whitespace inside them, so that once the value is
    complete end-of-sequence is the only token allowed (no padding before it, no wasted decode
    steps). ``compact=False`` lets the model lay JSON out with whitespace. A decoder that cannot
    honour it may ignore it.

    ``backend`` names the decoder a request asked for (``"auto"`` or None: the server's
    choice); one that is not installed, or does not support ``kind``, is a 400 naming
    ``backend_param``, the request field that carried the name.
    """

    kind: str
    value: Any = None
    param: str | None = None
    compact: bool = True
    backend: str | None = None
    backend_param: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown guided-decoding kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def cache_key(self) -> tuple[str, str]:
        """``(kind, canonical JSON of value)``: equal for equal constraints, whatever the key order."""
        try:
            text = json.dumps(self.value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            text = repr(self.value)
        return (self.kind if self.compact else self.kind + "+spaced"), text


def check_value(spec: GuidedSpec) -> None:
    """Shape checks every decoder can rely on (400 naming ``spec.param``)."""
    kind, value, param = spec.kind, spec.value, spec.param
    label = param or kind
    if kind == "json_schema" and not isinstance(value, dict):
        raise InvalidRequestError(f"{label}: the JSON schema must be a JSON object", param=param)
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise InvalidRequestError(f"{label}: must be a non-empty string", param=param)
    if kind == "structure" and not isinstance(value, dict):
        raise InvalidRequestError(f"{label}: the structure must be a JSON object", param=param)
    if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                             or not all(isinstance(c, str) for c in value)):
        raise InvalidRequestError(f"{label}: must be a non-empty list of strings", param=param)


def json_schema_spec(value: Any, param: str, *, compact: bool = True, allow_json_keyword: bool = False) -> GuidedSpec:
    """A JSON-schema constraint from a request field: a schema object, or a string holding one
    (vLLM, TGI). With ``allow_json_keyword``, the string ``"json"`` means any JSON object
    (Ollama's ``format``). Anything else is a 400 naming ``param``."""
    if isinstance(value, str):
        if allow_json_keyword and value.strip() == "json":
            return GuidedSpec("json_object", None, param=param, compact=compact)
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequestError(f"{param}: not a valid JSON schema (the string is not JSON)",
                                      param=param) from None
    if value is True or value == {}:  # a schema that accepts anything: any JSON value
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}: must be a JSON schema object (or a string holding one)", param=param)
    return GuidedSpec("json_schema", value, param=param, compact=compact)


def only_one(given: dict[str, GuidedSpec | None]) -> GuidedSpec | None:
    """The one constraint among a request's spellings (``{field: spec or None}``), None if
    none; two or more are a 400 naming them."""
    named = [(field, spec) for field, spec in given.items() if spec is not None]
    if len(named) > 1:
        fields = [field for field, _ in named]
        raise InvalidRequestError(f"only one of {', '.join(given)} may be given (one output constraint per "
                                  f"request); got {' and '.join(fields)}", param=fields[1])
    return named[0][1] if named else None
