"""Named contribution records that plugins hand to the core.

A record names a thing (a protocol, a backend, a parser) and points at the code that
implements it with a lazy ``"module:attr"`` target. Listing plugins reads records only, so
``llmserve plugins`` never imports torch, transformers or a dialect's FastAPI code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["protocol", "backend", "tool_parser", "reasoning_parser", "guided_decoder", "proposer"]


def resolve(target: str) -> Any:
    """Import ``"package.module:attr"`` (attr may be dotted) and return the attribute."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Contribution:
    """Base of every record.

    ``name`` is what users type (``--backend torch``, ``--tool-call-parser hermes``).
    ``target`` is the lazy ``"module:attr"`` of the implementation. ``overrides=True`` lets
    this record replace another plugin's record of the same kind and name (otherwise two
    records with one name are an error). ``options`` optionally points at a pydantic model
    (``"module:Model"``) validated from the YAML section named like the contribution.
    """

    name: str
    target: str
    description: str = ""
    overrides: bool = False
    options: str | None = None
    kind: Kind = field(default="protocol", init=False)

    def load(self) -> Any:
        """Import and return the implementation."""
        return resolve(self.target)


@dataclass(frozen=True)
class ProtocolSpec(Contribution):
    """A serving dialect. ``target`` is a ``Protocol`` subclass (see ``llmserve.server.protocol``).

    ``default_enabled`` says whether the dialect is served when ``--protocols`` is not given.
    ``aliases`` are extra names accepted by ``--protocols``.
    """

    default_enabled: bool = True
    aliases: tuple[str, ...] = ()
    kind: Kind = field(default="protocol", init=False)


@dataclass(frozen=True)
class BackendSpec(Contribution):
    """A model runner. ``target`` is a ``llmserve.engine.backend.Backend`` subclass."""

    kind: Kind = field(default="backend", init=False)


@dataclass(frozen=True)
class ToolParserSpec(Contribution):
    """A tool-call parser. ``aliases`` are extra names for ``--tool-call-parser``.

    ``template_markers``: how ``--tool-call-parser auto`` recognises the format in a model's chat
    template: strings that all occur in the template of a model that writes it (``("<tool_call>",
    "<function=")``). Of the parsers whose markers all occur, the most specific is chosen: the
    most markers, then the most marker characters, then the name (``llmserve.parsing.detect``);
    ``()``: never chosen from a template. Declared per name, so one class registered under two
    names (two versions of one format) may carry two sets.
    """

    aliases: tuple[str, ...] = ()
    template_markers: tuple[str, ...] = ()
    kind: Kind = field(default="tool_parser", init=False)


@dataclass(frozen=True)
class ReasoningParserSpec(Contribution):
    """A reasoning parser. ``aliases`` are extra names for ``--reasoning-parser``.

    ``template_markers``: as ``ToolParserSpec``'s, for ``--reasoning-parser auto``; a family's
    thinking tag together with its tool-call marker makes the family's parser more specific
    than one that only knows the tag.
    """

    aliases: tuple[str, ...] = ()
    template_markers: tuple[str, ...] = ()
    kind: Kind = field(default="reasoning_parser", init=False)


@dataclass(frozen=True)
class GuidedDecoderSpec(Contribution):
    """A guided-decoding backend. ``target`` is a ``llmserve.guided.GuidedDecoder`` subclass.

    ``--guided-decoding-backend NAME`` picks the preferred one; a kind it does not support goes
    to another installed decoder that does.
    """

    kind: Kind = field(default="guided_decoder", init=False)


@dataclass(frozen=True)
class ProposerSpec(Contribution):
    """A speculative-decoding proposer. ``target`` is a ``llmserve.engine.speculation.Proposer``
    subclass; ``--speculative-config '{"method": NAME, ...}'`` picks it by ``name``. With
    ``loads_model`` it runs a model of its own and is built with a third argument, a
    ``llmserve.engine.speculation.LoadModel`` that loads one as the server loads its own."""

    loads_model: bool = False
    kind: Kind = field(default="proposer", init=False)
