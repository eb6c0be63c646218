"""The models one server serves: a ``ModelSlot`` each, loaded when a request names it.

The first model (MODEL, or the first of ``--models`` when MODEL is not given) is the server's
default: it loads at start, ``/ready`` waits for it, routes without a model field (TGI, KServe's
unnamed ones) use it, and it stays loaded. Every other model loads on the first request naming it,
on a thread, while the loaded ones keep serving; requests for a model that is loading wait for it
(within their deadline). A load that fails answers the requests that waited with its error and is
tried again on a later request.

A request holds a lease on its model from routing to the end of its response, so a model is only
unloaded when idle: after ``--idle-unload-seconds`` (or the request's own ``keep_alive``, Ollama's
field: ``0`` unloads as soon as the request ends, negative keeps it), or to make room when
``--max-loaded-models`` or the memory would be exceeded (least recently used first). Unloading
stops the model's engine and returns its memory (the heap is trimmed).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from llmserve.errors import LLMServeError, OverloadedError, RequestTimeoutError
from llmserve.request_context import current_context
from llmserve.server.metrics import Metrics

if TYPE_CHECKING:
    from llmserve.config import ServerConfig
    from llmserve.engine.backend import ModelInfo
    from llmserve.engine.client import EngineClient
    from llmserve.guided import GuidedDecoding
    from llmserve.parsing.service import ParsingService

log = logging.getLogger("llmserve.server")

#: How often idle models are checked for expiry.
REAP_INTERVAL_S = 1.0


class ModelLoadError(LLMServeError):
    """A model a request named could not be loaded (the reason is in the message)."""

    status = 500
    code = "model_load_failed"


class ModelNotLoaded(Exception):
    """Raised by ``ServerContext.check_model`` for a model that is served but not loaded: the route
    wrapper loads it and runs the route again."""

    def __init__(self, slot: "ModelSlot") -> None:
        super().__init__(slot.name)
        self.slot = slot


@dataclass(eq=False)
class ModelSlot:
    """One servable model: its settings and, while loaded, its model, engine and services."""

    names: list[str]                    # names clients may use, the first reported; [] -> the model's own
    config: "ServerConfig"              # the server's configuration with this model's own settings
    pinned: bool = False                # the default model: loaded at start and never unloaded
    model: "ModelInfo | None" = None
    engine: "EngineClient | None" = None
    metrics: Metrics = field(default_factory=Metrics)
    guided: "GuidedDecoding | None" = None
    parsing: "ParsingService | None" = None
    state: str = "unloaded"             # unloaded | loading | loaded | failed
    error: str | None = None            # why the last load failed
    leases: int = 0                     # requests routed to it whose responses have not ended
    last_used: float = 0.0              # time.monotonic() of the last lease's end
    keep_alive: float | None = None     # 0: unload once its requests end (asked while it was busy)
    expires_at: float | None = None     # time.monotonic() when an idle model unloads (None: never)
    size_bytes: int = 0                 # memory measured across its load
    loading: "asyncio.Future[None] | None" = field(default=None, repr=False)

    @property
    def source(self) -> str:
        """What it is loaded from: a path or a Hugging Face id (the config's ``model``)."""
        return str(self.config.llm.model or "")

    @property
    def served_names(self) -> list[str]:
        if self.names:
            return list(self.names)
        return [self.model.name] if self.model is not None else [self.source or "llmserve"]

    @property
    def name(self) -> str:
        return self.served_names[0]

    @property
    def input_modalities(self) -> list[str]:
        """What requests may send the model: its loaded model's own, else what every model takes."""
        from llmserve.engine.backend import TEXT_ONLY

        return list(self.model.input_modalities if self.model is not None else TEXT_ONLY)

    def answers_to(self, name: str) -> bool:
        """Whether a request naming ``name`` means this model (a served name, its source or path)."""
        if name in self.served_names or (self.source and name == self.source):
            return True
        return self.model is not None and name == self.model.path


def entry_slot(config: "ServerConfig", entry: str | dict[str, Any]) -> ModelSlot:
    """The slot of one ``--models`` entry: ``SOURCE``, ``NAME=SOURCE`` or a YAML mapping of the
    model's own settings; its name is the given one, else what the backend would call it (a Hub
    id as written, a local path by its file or folder name)."""
    if isinstance(entry, str):
        name, _, source = entry.rpartition("=") if "=" in entry else ("", "", entry)
        entry = {"model": source, **({"served_model_name": [name]} if name else {})}
    own = dict(entry)
    names = own.pop("served_model_name", None) or []
    names = [names] if isinstance(names, str) else list(names)
    source = str(own["model"])
    if not names:
        local = os.path.exists(source) or source.startswith((".", "/", "~"))
        names = [os.path.basename(source.rstrip("/\\")) if local else source]
    llm = config.llm.model_copy(update={k: v for k, v in own.items() if k in type(config.llm).model_fields})
    llm.served_model_name = names
    cache = config.cache.model_copy(update={k: v for k, v in own.items() if k in type(config.cache).model_fields})
    return ModelSlot(names=names, config=config.model_copy(update={"llm": llm, "cache": cache}))


def files_size(source: str) -> int:
    """Bytes of a local model's files (a file, or a folder's weights), 0 for a Hub id not fetched."""
    if os.path.isfile(source):
        return os.path.getsize(source)
    if not os.path.isdir(source):
        return 0
    total = 0
    for name in os.listdir(source):
        if name.endswith((".safetensors", ".gguf")):
            try:
                total += os.path.getsize(os.path.join(source, name))
            except OSError:
                continue
    return total


def available_memory(device: str) -> int | None:
    """Bytes a new model can take now: free GPU memory for a CUDA model, else the system's
    ``MemAvailable``; None where it cannot be measured."""
    if device == "cuda" or (device == "auto" and _cuda_ready()):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cuda_ready() -> bool:
    import sys

    torch = sys.modules.get("torch")  # a CUDA model has imported it; never imported here for a CPU one
    return bool(torch is not None and torch.cuda.is_available())


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cuda_reserved_bytes() -> int:
    """What torch's CUDA allocator holds in this process (0 before any CUDA work)."""
    if not _cuda_ready():
        return 0
    import torch

    return int(torch.cuda.memory_reserved()) if torch.cuda.is_initialized() else 0


def _held_bytes() -> int:
    """What a model's load adds to: this process's RSS (a CPU model's weights and KV cache), plus
    the GPU memory its allocator reserved (a CUDA model's, which the RSS never shows)."""
    return _resident_bytes() + _cuda_reserved_bytes()


class ModelPool:
    """The server's models (``context.pool``): find one by name, load it on demand, lease it to
    requests and unload it when idle or to make room.

    ``loader(slot)`` (blocking, run on a thread) loads a slot's model and engine and fills
    ``slot.model`` / ``slot.engine``; ``on_loaded(slot)`` then runs on the event loop.
    """

    def __init__(self, default: ModelSlot, others: list[ModelSlot] | None = None) -> None:
        default.pinned = True
        self.default = default
        self.slots: list[ModelSlot] = [default, *(others or [])]
        self.loader: Callable[[ModelSlot], None] | None = None
        self.on_loaded: Callable[[ModelSlot], None] | None = None
        self.max_loaded: int | None = None
        self.idle_unload: float | None = None
        self._lock: asyncio.Lock | None = None  # one load at a time (memory is measured across it)

    def configure(self, max_loaded: int | None, idle_unload: float | None) -> None:
        self.max_loaded, self.idle_unload = max_loaded, idle_unload

    # -- lookup -----------------------------------------------------------------------------------
    def find(self, name: str) -> ModelSlot | None:
        return next((s for s in self.slots if s.answers_to(name)), None)

    @property
    def several(self) -> bool:
        return len(self.slots) > 1

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots if s.engine is not None]

    # -- leases -----------------------------------------------------------------------------------
    def lease(self, slot: ModelSlot) -> None:
        slot.leases += 1
        slot.expires_at = None

    def release(self, slot: ModelSlot, keep_alive: float | None = None) -> None:
        """A request on ``slot`` ended; ``keep_alive`` (seconds, the request's own; negative:
        forever) replaces the slot's idle time from now on."""
        slot.leases = max(0, slot.leases - 1)
        slot.last_used = time.monotonic()
        if keep_alive is not None:
            wait = None if keep_alive < 0 else keep_alive
        else:
            wait = slot.keep_alive if slot.keep_alive is not None else self.idle_unload
        if slot.leases or slot.pinned or wait is None:
            slot.expires_at = None
            return
        slot.expires_at = slot.last_used + wait
        if wait == 0:
            self._soon(self.unload(slot))

    @staticmethod
    def _soon(coro: Any) -> None:
        try:
            asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop (offline use): nothing to unload on
            coro.close()

    # -- loading ----------------------------------------------------------------------------------
    async def ensure(self, slot: ModelSlot) -> None:
        """Return once ``slot`` is loaded, loading it if need be; raise ``ModelLoadError`` when
        its load fails (every request waiting for that load gets the same error)."""
        while slot.engine is None:
            if slot.loading is None:
                slot.loading = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().create_task(self._load(slot, slot.loading))
            waiting = slot.loading
            await asyncio.shield(waiting)  # a request that gives up leaves the load running for the others

    async def _load(self, slot: ModelSlot, done: "asyncio.Future[None]") -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:
                await self._make_room(slot)
                slot.state, slot.error = "loading", None
                log.info("loading model %s (%s) on demand", slot.name, slot.source)
                started, before = time.monotonic(), _held_bytes()
                assert self.loader is not None, "the pool has no loader"
                await asyncio.to_thread(self.loader, slot)
                slot.size_bytes = max(0, _held_bytes() - before) or slot.size_bytes
                slot.state, slot.last_used = "loaded", time.monotonic()
                slot.expires_at, slot.keep_alive = None, None
                if not slot.pinned and self.idle_unload is not None:
                    # The idle clock starts now: a model loaded ahead (/models/load) that no request
                    # ever uses still unloads. The request that started a load leases it at once.
                    slot.expires_at = slot.last_used + self.idle_unload
                if self.on_loaded is not None:
                    self.on_loaded(slot)
                log.info("model %s loaded in %.1f s", slot.name, time.monotonic() - started)
                done.set_result(None)
        except OverloadedError as exc:  # no room now: not a failure of the model
            slot.state = "unloaded"
            done.set_exception(exc)
            done.exception()
        except BaseException as exc:  # every waiting request gets it, as one line
            slot.state = "failed"
            slot.error = _one_line(exc)
            log.error("model %s failed to load: %s", slot.name, slot.error)
            if not done.done():
                done.set_exception(ModelLoadError(f"the model `{slot.name}` could not be loaded: {slot.error}"))
                done.exception()  # retrieved here: a load nobody waits for any more is not an asyncio warning
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            slot.loading = None

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload idle models (least recently used first) while ``--max-loaded-models`` would be
        exceeded, and while the memory free now is less than ``slot`` took when it last loaded (or
        its files' size, before its first load); refuse (503) when every loaded model is busy."""
        while self.max_loaded is not None and len([s for s in self.loaded() if not s.pinned]) >= self.max_loaded:
            if not await self._unload_idlest():
                raise OverloadedError(f"cannot load `{slot.name}`: {self.max_loaded} models are loaded "
                                      "(--max-loaded-models) and all of them are serving requests; retry later")
        need = slot.size_bytes or files_size(slot.source)
        while need and (free := available_memory(slot.config.llm.device)) is not None and free < need:
            log.info("loading %s needs about %.2f GiB, %.2f GiB are free: unloading an idle model", slot.name,
                     need / 2**30, free / 2**30)
            if not await self._unload_idlest():
                break  # nothing left to unload: the load itself says whether it fits

    async def _unload_idlest(self) -> bool:
        idle = sorted((s for s in self.loaded() if not s.pinned and not s.leases), key=lambda s: s.last_used)
        return bool(idle) and await self.unload(idle[0])

    # -- unloading --------------------------------------------------------------------------------
    async def unload(self, slot: ModelSlot, force: bool = False) -> bool:
        """Stop ``slot``'s engine and let its memory go; False when it is pinned, busy (unless
        ``force``) or not loaded."""
        engine = slot.engine
        if engine is None or slot.pinned or (slot.leases and not force):
            return False
        slot.engine, slot.model, slot.guided, slot.parsing = None, None, None, None
        slot.state, slot.expires_at = "unloaded", None
        await asyncio.to_thread(_stop, engine)
        log.info("model %s unloaded", slot.name)
        return True

    async def reap(self) -> None:
        """Unload idle models whose time is up, for as long as the server runs."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for slot in self.loaded():
                if slot.expires_at is not None and slot.expires_at <= now and not slot.leases:
                    await self.unload(slot)

    def shutdown(self) -> None:
        """Stop every engine (the server is exiting)."""
        for slot in self.loaded():
            engine, slot.engine = slot.engine, None
            if engine is not None:
                engine.shutdown()


async def run_routed(context: Any, call: Callable[[], Any]) -> Any:
    """``await call()``, a route's handler (``context``: the ``ServerContext``); when the model it
    names must be loaded first (``ModelNotLoaded``), load it (within the request's deadline) and
    run the route again, giving back what its first run reserved."""
    ctx = current_context()
    reserved = ctx.sequences if ctx is not None else 0
    for _ in range(len(context.pool.slots) + 1):  # another load may evict it meanwhile, once per model at most
        try:
            return await call()
        except ModelNotLoaded as exc:
            if ctx is not None:
                context.admission.rollback(ctx, reserved)
            deadline = ctx.deadline if ctx is not None else None
            try:
                async with asyncio.timeout(None if deadline is None else max(0.0, deadline - time.monotonic())):
                    await context.pool.ensure(exc.slot)
            except TimeoutError:
                raise RequestTimeoutError(f"the request timed out while the model `{exc.slot.name}` was "
                                          "loading") from None
    raise OverloadedError("the model was unloaded again before the request could use it; retry")


def _stop(engine: "EngineClient") -> None:
    """Shut the engine down and hand its memory back to the system."""
    from llmserve.server.memory import heap_trimmer

    engine.shutdown()
    del engine
    gc.collect()
    if (trim := heap_trimmer()) is not None:
        trim()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
