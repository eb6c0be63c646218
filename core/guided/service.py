"""The server's guided-decoding front door (``ServerContext.guided``): picks a decoder for each
constraint, builds each decoder once, and caches compiled constraints.

A dialect turns its request fields into a ``GuidedSpec`` and awaits ``compile_async``; the
result is a mask factory it puts in ``GenerateRequest.mask_factory``. Compiling is bounded
(``llmserve.guided.bounds``): checked against ``--guided-max-*`` first, then run on the one
compile worker (``llmserve.guided.worker``) under ``--guided-compile-timeout``. Decoders come
from plugins through the ``register_guided_decoders`` hook; ``--guided-decoding-backend`` names
the preferred one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Any

from llmserve.errors import GenerationError, InvalidRequestError, LLMServeError
from llmserve.guided.bounds import GuidedLimits, check_bounds
from llmserve.guided.decoder import GuidedDecoder
from llmserve.guided.spec import KINDS, GuidedSpec, MaskFactory, check_value
from llmserve.guided.worker import CompileWorker

log = logging.getLogger("llmserve.guided")

# "<noun> decoding needs a guided-decoding plugin that supports <plural>"
_NOUN = {"json_schema": "JSON-schema-guided", "json_object": "JSON-guided", "regex": "regex-guided",
         "choice": "choice-guided", "grammar": "grammar-guided", "structure": "structure-guided"}
_PLURAL = {"json_schema": "JSON schemas", "json_object": "JSON objects", "regex": "regular expressions",
           "choice": "choice lists", "grammar": "grammars", "structure": "structures"}


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

    def decoder_name(self, kind: str, param: str | None = None, backend: str | None = None,
                     backend_param: str | None = None) -> str:
        """The decoder that handles ``kind`` (``backend`` if the request named one in its field
        ``backend_param``), or a 400 naming what is installed."""
        if backend and backend != "auto":
            return self._requested(backend, kind, backend_param or "backend")
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

    def _requested(self, backend: str, kind: str, field: str) -> str:
        names = self._names()
        wanted = backend.replace("_", "-")
        if wanted not in names:
            raise InvalidRequestError(f"{field}: {backend!r} is not installed on this server; "
                                      f"installed: {', '.join(names) or 'none'} (or 'auto')", param=field)
        cls = self._class(wanted)
        if cls is None or kind not in cls.kinds:
            raise InvalidRequestError(f"{field}: {backend!r} does not support {_PLURAL[kind]}", param=field)
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
        name = self.decoder_name(spec.kind, spec.param, spec.backend, spec.backend_param)
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
