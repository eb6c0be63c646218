"""Guided (constrained) decoding: the dialect-neutral spec, the decoder plugin interface and
the core-side helper that picks a decoder and caches compiled constraints.

A protocol turns its request fields into a ``GuidedSpec`` (``json_schema_spec``,
``structured_outputs_spec`` and ``only_one`` do the common spellings, with 400s naming the
field) and awaits the server's ``GuidedDecoding.compile_async`` (``context.guided``); the
result is a mask factory the protocol puts in ``GenerateRequest.mask_factory``. Compiling is
bounded (``guided_bounds``): checked against ``--guided-max-*`` first, then run on the one
compile worker under ``--guided-compile-timeout``. Decoders come from plugins through the
``register_guided_decoders`` hook; ``--guided-decoding-backend`` names the preferred one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from llmserve.errors import GenerationError, InvalidRequestError, LLMServeError
from llmserve.guided_bounds import CompileWorker, GuidedLimits, check_bounds
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

    ``backend`` names the decoder a request asked for; one that is not installed, or does not
    support ``kind``, is a 400 naming ``guided_decoding_backend`` (``"auto"`` or None: the
    server's choice).
    """

    kind: str
    value: Any = None
    param: str | None = None
    compact: bool = True
    backend: str | None = None  # a decoder the request named (vLLM's guided_decoding_backend); None: the server's

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
                 eos_token_ids: list[int], cache_size: int = 256, limits: GuidedLimits | None = None) -> None:
        self.limits = limits or GuidedLimits()
        self.worker = CompileWorker(self.limits.compile_timeout, self.limits.max_pending)
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

    def decoder_name(self, kind: str, param: str | None = None, backend: str | None = None) -> str:
        """The decoder that handles ``kind`` (``backend`` if the request named one), or a 400
        naming what is installed."""
        if backend and backend != "auto":
            return self._requested(backend, kind)
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

    def _requested(self, backend: str, kind: str) -> str:
        names = self._names()
        wanted = backend.replace("_", "-")
        if wanted not in names:
            raise InvalidRequestError(f"guided_decoding_backend: {backend!r} is not installed on this server; "
                                      f"installed: {', '.join(names) or 'none'} (or 'auto')",
                                      param="guided_decoding_backend")
        cls = self._class(wanted)
        if cls is None or kind not in cls.kinds:
            raise InvalidRequestError(f"guided_decoding_backend: {backend!r} does not support {_PLURAL[kind]}",
                                      param="guided_decoding_backend")
        return wanted

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
    def _lookup(self, spec: GuidedSpec) -> tuple[tuple[str, str, str], MaskFactory | None]:
        """Checks (shape, bounds, decoder choice), then the cache: ``(key, hit or None)``."""
        check_value(spec)
        check_bounds(spec.kind, spec.value, spec.param, self.limits)
        name = self.decoder_name(spec.kind, spec.param, spec.backend)
        key = (name, *spec.cache_key())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        return key, hit

    def _job(self, key: tuple[str, str, str], spec: GuidedSpec) -> Any:
        def run() -> MaskFactory:
            decoder = self.decoder(key[0])  # built once, before the budget starts
            self.worker.begin_budget()
            return decoder.compile(spec)
        return self.worker.submit(key, run, spec.param or spec.kind, spec.param)

    def _store(self, key: tuple[str, str, str], factory: MaskFactory) -> MaskFactory:
        with self._lock:
            factory = self._cache.setdefault(key, factory)  # a concurrent compile may have won
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return factory

    def compile(self, spec: GuidedSpec) -> MaskFactory:
        """The mask factory for ``spec``, from the cache or freshly compiled on the compile
        worker; blocks the calling thread (prefer ``compile_async`` in a request handler)."""
        key, hit = self._lookup(spec)
        if hit is not None:
            return hit
        return self._store(key, self._job(key, spec).future.result())

    async def compile_async(self, spec: GuidedSpec) -> MaskFactory:
        """``compile`` for request handlers: the checks run on a worker thread, the compilation on
        the compile worker, and a client that goes away (this task cancelled) stops waiting; the
        last one to leave cancels the compilation."""
        key, hit = await asyncio.to_thread(self._lookup, spec)
        if hit is not None:
            return hit
        job = self._job(key, spec)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future = loop.create_future()

        def done(future: Any) -> None:
            loop.call_soon_threadsafe(_settle, waiter, future)
        job.future.add_done_callback(done)
        try:
            factory = await waiter
        except asyncio.CancelledError:
            self.worker.release(job)
            raise
        return self._store(key, factory)


def _settle(waiter: asyncio.Future, future: Any) -> None:
    if waiter.done():
        return
    if future.cancelled():
        waiter.set_exception(InvalidRequestError("the constraint's compilation was cancelled"))
    elif future.exception() is not None:
        waiter.set_exception(future.exception())
    else:
        waiter.set_result(future.result())


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


# -- building specs from request fields ----------------------------------------------------------
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


# vLLM's StructuredOutputsParams: the constraint keys (exactly one) and the options beside them.
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "structural_tag")


def structured_outputs_spec(obj: Any, param: str = "structured_outputs") -> GuidedSpec | None:
    """vLLM's ``structured_outputs`` object -> a spec (None when it sets no constraint). Exactly
    one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``; an unknown key, a
    ``structural_tag`` or a ``whitespace_pattern`` (not supported here) is a 400 naming it."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{param}: must be an object such as {{\"json\": {{...}}}}", param=param)
    unknown = [k for k in obj if k not in STRUCTURED_KINDS and k not in STRUCTURED_OPTIONS]
    if unknown:
        raise InvalidRequestError(f"{param}.{unknown[0]}: unknown structured-outputs key; expected one of "
                                  f"{', '.join(STRUCTURED_KINDS)}", param=f"{param}.{unknown[0]}")
    for key in ("structural_tag", "whitespace_pattern"):
        if obj.get(key) is not None:
            raise InvalidRequestError(f"{param}.{key}: not supported by this server", param=f"{param}.{key}")
    for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        if obj.get(key) is not None and not isinstance(obj[key], bool):
            raise InvalidRequestError(f"{param}.{key}: must be a boolean", param=f"{param}.{key}")
    given = [k for k in STRUCTURED_KINDS if obj.get(k) is not None and not (k == "json_object" and obj[k] is False)]
    if len(given) > 1:
        raise InvalidRequestError(f"{param}: only one of {', '.join(STRUCTURED_KINDS)} may be given; got "
                                  f"{' and '.join(given)}", param=f"{param}.{given[1]}")
    if not given:
        return None
    key = given[0]
    where = f"{param}.{key}"
    if key == "json":
        spec = json_schema_spec(obj[key], where)
        if obj.get("disable_additional_properties"):
            spec = GuidedSpec("json_schema", closed_objects(spec.value), param=where)
        return spec
    if key == "json_object":
        if obj[key] is not True:
            raise InvalidRequestError(f"{where}: must be true", param=where)
        return GuidedSpec("json_object", None, param=where)
    return GuidedSpec(STRUCTURED_KINDS[key], obj[key], param=where)


def closed_objects(schema: Any, _depth: int = 0) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    (vLLM's ``disable_additional_properties``). Only subschema positions are visited."""
    if _depth > 256 or not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub, _depth + 1) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, _depth + 1) for sub in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key], _depth + 1)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# vLLM's legacy request fields and the kind each asks for.
LEGACY_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def legacy_specs(body: Any) -> dict[str, GuidedSpec | None]:
    """``{field: spec}`` for the legacy ``guided_*`` attributes ``body`` has set (``guided_json``
    may be a schema or a string holding one)."""
    out: dict[str, GuidedSpec | None] = {}
    for field, kind in LEGACY_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            spec = json_schema_spec(value, field) if kind == "json_schema" else GuidedSpec(kind, value, param=field)
            out[field] = spec
    return out


def only_one(given: dict[str, GuidedSpec | None]) -> GuidedSpec | None:
    """The one constraint among a request's spellings (``{field: spec or None}``), None if
    none; two or more are a 400 naming them."""
    named = [(field, spec) for field, spec in given.items() if spec is not None]
    if len(named) > 1:
        fields = [field for field, _ in named]
        raise InvalidRequestError(f"only one of {', '.join(given)} may be given (one output constraint per "
                                  f"request); got {' and '.join(fields)}", param=fields[1])
    return named[0][1] if named else None
