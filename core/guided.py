"""Guided (constrained) decoding: the dialect-neutral spec, the decoder plugin interface and
the core-side helper that picks a decoder and caches compiled constraints.

A protocol turns its request fields into a ``GuidedSpec`` and asks the server's
``GuidedDecoding`` (``context.guided``) to compile it; the result is a mask factory the
protocol puts in ``GenerateRequest.mask_factory``. Decoders come from plugins through the
``register_guided_decoders`` hook; ``--guided-decoding-backend`` names the preferred one.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from llmserve.errors import GenerationError, InvalidRequestError, LLMServeError
from llmserve.request import LogitsMask

log = logging.getLogger("llmserve.guided")

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# "<noun> decoding needs a guided-decoding plugin that supports <plural>"
_NOUN = {"json_schema": "JSON-schema-guided", "json_object": "JSON-guided", "regex": "regex-guided",
         "choice": "choice-guided", "grammar": "grammar-guided"}
_PLURAL = {"json_schema": "JSON schemas", "json_object": "JSON objects", "regex": "regular expressions",
           "choice": "choice lists", "grammar": "grammars"}

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

    ``param`` names the request field the constraint came from (``"guided_json"``,
    ``"response_format"``, ...); decoders put it in the ``InvalidRequestError`` they raise so
    the client learns which field is wrong. It is not part of the cache key.

    ``compact`` (the default; it matters for the JSON kinds) asks for compact JSON: no
    whitespace outside strings and no run of whitespace inside them, so that once the value is
    complete end-of-sequence is the only token allowed (no padding before it, no wasted decode
    steps). ``compact=False`` lets the model lay JSON out with whitespace. A decoder that cannot
    honour it may ignore it.
    """

    kind: str
    value: Any = None
    param: str | None = None
    compact: bool = True

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


class GuidedDecoder(ABC):
    """Turns a ``GuidedSpec`` into per-sequence logits masks for one tokenizer.

    A plugin contributes a subclass with a ``GuidedDecoderSpec`` record. The server builds
    one instance, on the first request that needs it (never at start-up), as
    ``cls(tokenizer, vocab_size, eos_token_ids)``, and keeps it for its lifetime; expensive
    per-tokenizer preparation (vocabulary tables, prefix trees) belongs in ``__init__``.

    Class attributes:

    - ``name``: a display name (the record's ``name`` is what users type).
    - ``kinds``: the ``GuidedSpec.kind`` values this decoder supports. The server never calls
      ``compile`` with another kind.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """``tokenizer`` is the model's tokenizer (a transformers tokenizer, or anything with
        ``encode``, ``decode`` and ``convert_ids_to_tokens``); ``vocab_size`` is the number of
        logit rows (it may exceed ``len(tokenizer)``); ``eos_token_ids`` end a sequence and
        must be allowed once the constraint is complete, so that generation stops."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @abstractmethod
    def compile(self, spec: GuidedSpec) -> MaskFactory:
        """Validate and prepare ``spec``; return a factory of fresh ``LogitsMask`` objects.

        The server caches the returned factory per ``spec.cache_key()`` and reuses it for every
        request with the same constraint, so it must be stateless; the engine calls it once per
        sequence and each mask then holds that sequence's state. ``mask.allowed(output_ids)``
        is called on the engine thread before every sampled token with all tokens generated so
        far, and returns the ids that may come next (callers must not modify the list).

        Raise ``llmserve.errors.InvalidRequestError(message, param=spec.param)`` for a value
        the client got wrong (an invalid schema or regex, a feature the decoder cannot
        enforce). ``compile`` may be called from worker threads, concurrently.
        """


class GuidedDecoding:
    """The server's guided-decoding front door (``ServerContext.guided``).

    Picks the decoder for each kind (the configured ``backend`` if it supports the kind, else
    the first other installed decoder that does), constructs each decoder once, lazily, and
    keeps the last ``cache_size`` compiled constraints in an LRU keyed by
    ``(kind, canonical JSON of value)``. Thread-safe.
    """

    def __init__(self, registry: Any, backend: str | None, tokenizer: Any, vocab_size: int,
                 eos_token_ids: list[int], cache_size: int = 256) -> None:
        self.registry = registry
        self.backend = backend or ""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._classes: dict[str, Any] = {}
        self._decoders: dict[str, GuidedDecoder] = {}
        self._failed: dict[str, str] = {}
        self._cache: OrderedDict[tuple[str, str, str], MaskFactory] = OrderedDict()
        self._lock = threading.Lock()       # guards the cache and the class table
        self._build_lock = threading.Lock()  # one decoder construction at a time

    # -- decoder choice ------------------------------------------------------------------------
    def _names(self) -> list[str]:
        names = self.registry.names("guided_decoder") if self.registry is not None else []
        return ([self.backend] if self.backend in names else []) + [n for n in names if n != self.backend]

    def _class(self, name: str) -> Any:
        with self._lock:
            if name not in self._classes:
                try:
                    self._classes[name] = self.registry.load("guided_decoder", name)
                except LLMServeError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a broken plugin must not break requests
                    log.error("%s", exc)
                    self._classes[name] = None
            return self._classes[name]

    def installed(self) -> list[tuple[str, frozenset[str] | None]]:
        """``(name, kinds)`` of every installed decoder; ``kinds`` is None if it failed to import."""
        out = []
        for name in self._names():
            cls = self._class(name)
            out.append((name, frozenset(cls.kinds) if cls is not None else None))
        return out

    def decoder_name(self, kind: str, param: str | None = None) -> str:
        """The decoder that handles ``kind``, or a 400 naming what is installed."""
        for name in self._names():
            cls = self._class(name)
            if cls is not None and kind in cls.kinds:
                return name
        order = {k: i for i, k in enumerate(KINDS)}
        shown = [f"{n} ({', '.join(sorted(k, key=lambda kind: order[kind]))})" if k is not None
                 else f"{n} (failed to load)"
                 for n, k in self.installed()]
        raise InvalidRequestError(
            f"{_NOUN[kind]} decoding needs a guided-decoding plugin that supports {_PLURAL[kind]}; "
            f"installed: {', '.join(shown) or 'none'}", param=param)

    def decoder(self, name: str) -> GuidedDecoder:
        """The constructed decoder ``name`` (built on first use)."""
        decoder = self._decoders.get(name)
        if decoder is not None:
            return decoder
        with self._build_lock:
            if name in self._decoders:
                return self._decoders[name]
            if name in self._failed:
                raise GenerationError(self._failed[name])
            cls = self._class(name)
            try:
                decoder = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            except Exception as exc:  # logged with its traceback; requests get one line
                log.exception("guided decoder '%s' failed to start", name)
                self._failed[name] = f"guided decoder '{name}' failed to start: {type(exc).__name__}: {exc}"
                raise GenerationError(self._failed[name]) from None
            self._decoders[name] = decoder
            return decoder

    # -- compiling -----------------------------------------------------------------------------
    def compile(self, spec: GuidedSpec) -> MaskFactory:
        """The mask factory for ``spec``, from the cache or freshly compiled."""
        check_value(spec)
        name = self.decoder_name(spec.kind, spec.param)
        key = (name, *spec.cache_key())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        factory = self.decoder(name).compile(spec)
        with self._lock:
            factory = self._cache.setdefault(key, factory)  # a concurrent compile may have won
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return factory


def check_value(spec: GuidedSpec) -> None:
    """Shape checks every decoder can rely on (400 naming ``spec.param``)."""
    kind, value, param = spec.kind, spec.value, spec.param
    label = param or kind
    if kind == "json_schema" and not isinstance(value, dict):
        raise InvalidRequestError(f"{label}: the JSON schema must be a JSON object", param=param)
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise InvalidRequestError(f"{label}: must be a non-empty string", param=param)
    if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                             or not all(isinstance(c, str) for c in value)):
        raise InvalidRequestError(f"{label}: must be a non-empty list of strings", param=param)
