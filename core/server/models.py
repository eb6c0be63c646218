"""Which models a server serves: MODEL, ``--models`` entries, a ``--models-dir`` folder and the
Hugging Face cache, as slots of the server's ``ModelPool`` (``llmserve.server.pool``)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from llmserve import progress
from llmserve.errors import ConfigError
from llmserve.server.pool import ModelSlot, entry_slot

if TYPE_CHECKING:
    from llmserve.config import ServerConfig
    from llmserve.engine.engine import LLMEngine
    from llmserve.hooks.registry import Registry
    from llmserve.server.context import ServerContext

# ``max_num_seqs`` on CUDA when the user sets none (docs/engine.md#the-cuda-path).
CUDA_MAX_NUM_SEQS = 256

log = logging.getLogger("llmserve.server")


def folder_entries(folder: str) -> list[str]:
    """``NAME=PATH`` for every GGUF model (a split one by its first part; projectors left out) and
    every model directory (one holding a ``config.json``) in ``folder``, named by file name."""
    from llmserve.models.select import SPLIT, gguf_models

    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise ConfigError(f"--models-dir {folder!r}: cannot list it ({exc.strerror or exc})") from None
    entries = []
    for label in gguf_models([n for n in names if os.path.isfile(os.path.join(folder, n))]):
        if "mmproj" in label.lower():
            continue
        split = SPLIT.fullmatch(label)
        stem = split.group("stem") if split else label[: -len(".gguf")]
        entries.append(f"{stem}={os.path.join(folder, label)}")
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
            entries.append(f"{name}={path}")
    return entries


def cached_entries() -> list[str]:
    """``NAME=PATH`` for every model in the local Hugging Face cache (its ``llmserve ls`` name)."""
    from llmserve.models.cache import list_cached

    seen: dict[str, str] = {}
    for model in list_cached():
        seen.setdefault(model.name, model.path)  # newest snapshot first
    return [f"{name}={path}" for name, path in seen.items()]


def pull_slot(context: "ServerContext", text: str) -> ModelSlot:
    """Fetch the Hugging Face model ``text`` (``org/name[:QUANT]``, ``hf.co/`` allowed; never a
    path) into the cache and serve it, loaded on its first request (``--allow-pull``); blocking.
    A model already served is returned as it is."""
    from llmserve.errors import InvalidRequestError, NotFoundError
    from llmserve.models.ref import parse_ref
    from llmserve.models.resolve import plan_model

    ref = parse_ref(text)
    if ref is None:
        raise InvalidRequestError(f"`{text[:200]}` is not a Hugging Face repo id (org/name or org/name:QUANT)",
                                  param="model")
    name = ref.name
    found = context.pool.find(name) or context.pool.find(text)
    if found is not None:
        return found
    llm = context.config.llm
    try:
        plan_model(name, offline=llm.offline, token=llm.hf_token, mmproj=True).resolve()
    except ConfigError as exc:
        raise NotFoundError(f"cannot pull {name}: {exc}", param="model") from None
    slot = entry_slot(context.config, name)
    if context.pool.find(name) is None:  # another pull of it may have finished meanwhile
        context.pool.slots.append(slot)
        log.info("pulled %s: served as %s, loaded on its first request", name, slot.name)
    return context.pool.find(name) or slot


def add_models(context: "ServerContext") -> None:
    """Give ``context.pool`` a slot for every model the configuration names beside MODEL; without
    MODEL, the first of them becomes the default model (the one loaded at start)."""
    config = context.config
    router = config.router
    if router.allow_pull and not config.http.api_key:
        raise ConfigError("--allow-pull needs --api-key: a pull downloads into this machine's cache, which only "
                          "a client holding a key may ask for")
    entries: list[str | dict[str, Any]] = list(router.models)
    if router.models_dir:
        entries += folder_entries(router.models_dir)
    if router.serve_cached_models:
        entries += cached_entries()
    if not entries:
        return
    if config.llm.model is None:
        first = entry_slot(config, entries.pop(0))
        config.llm = first.config.llm
        config.cache = first.config.cache
        pool_default = context.pool.default
        pool_default.config, pool_default.names = config, list(first.names)
    pool = context.pool
    taken = {n: pool.default for n in pool.default.served_names}
    for entry in entries:
        slot = entry_slot(config, entry)
        clash = next((n for n in slot.names if n in taken), None)
        if clash is not None:
            log.warning("model %s (%s) not served: the name %r is already %s's", slot.name, slot.source, clash,
                        taken[clash].source or "the default model")
            continue
        taken.update((n, slot) for n in slot.names)
        pool.slots.append(slot)
    log.info("serving %d models: %s loads now, the others on their first request", len(pool.slots),
             pool.default.name)


class SlotLoader:
    """Loads a slot's model and starts its engine (``ModelPool.loader``), the same way for the
    default model at start and for every model loaded on demand."""

    def __init__(self, registry: "Registry", options: dict[str, Any], template: Any, detect_parsers: bool) -> None:
        self.registry, self.options = registry, options
        self.template = template            # --chat-template, replacing every model's own
        self.detect_parsers = detect_parsers  # --tool-call-parser / --reasoning-parser auto
        self._ready: dict[int, Any] = {}    # backends made ahead of their load

    def _backend(self, config: "ServerConfig") -> Any:
        name = config.llm.backend
        record, cls = self.registry.get("backend", name).record, self.registry.load("backend", name)
        # A backend that declares options gets them as a second argument; one that does not keeps
        # the plain ``cls(config)`` contract.
        return cls(config, self.options[record.name]) if record.options else cls(config)

    def prepare(self, slot: ModelSlot) -> None:
        """Make ``slot``'s backend now, so that what it refuses fails before anything loads."""
        self._ready[id(slot)] = self._backend(slot.config)

    def _engine(self, slot: ModelSlot) -> "LLMEngine":
        from llmserve.engine.engine import LLMEngine
        from llmserve.parsing.service import ParsingService
        from llmserve.server.memory import heap_trimmer

        own = slot.config
        backend = self._ready.pop(id(slot), None) or self._backend(own)
        model = backend.load()
        if model.device == "cuda" and "max_num_seqs" not in own.scheduler.model_fields_set:
            # A GPU step costs about the same for 64 rows as for 256 (the weights are read once
            # either way), and the CUDA graphs are captured up to this size: a larger default batch.
            own.scheduler.max_num_seqs = CUDA_MAX_NUM_SEQS
        if self.template is not None:
            model.chat_template = self.template
            model.tokenizer.chat_template = self.template
        if self.detect_parsers:  # the parsers the model's chat template points at
            slot.parsing = ParsingService.for_model(own.parsing, self.registry, model)
        proposer = None
        if (spec := own.scheduler.speculative_config) is not None:  # built before the pool: a refusal is cheap
            entry = self.registry.get("proposer", spec.method)
            cls = self.registry.load("proposer", spec.method)
            proposer = (cls(spec, model, self._draft_loader(own, model)) if getattr(entry.record, "loads_model", False)
                        else cls(spec, model))
        with progress.phase("allocating the KV pool"):
            engine = LLMEngine(backend, model, own, proposer)
        slot.model = model
        # Loading parses and frees a lot (tokenizer and GGUF metadata conversion, checkpoint
        # headers): hand those freed heap pages back now rather than after the first requests.
        if (trim := heap_trimmer()) is not None:
            trim()
        return engine

    def _draft_loader(self, own: "ServerConfig", target: Any) -> Any:
        """The ``LoadModel`` a model-running proposer gets: another model on ``own``'s backend,
        dtype and device, for the target's context length (fetched as MODEL is when missing)."""
        from llmserve.models.resolve import apply_resolved, plan_config_model

        def load(name: str) -> tuple[Any, Any]:
            config = own.model_copy(deep=True)
            config.llm = own.llm.model_copy(update={
                "model": name, "revision": None, "served_model_name": [], "tokenizer": None, "seed": None,
                "generation_config": "vllm", "max_model_len": target.max_model_len, "task": "generate"})
            config.scheduler.speculative_config = None
            source = plan_config_model(config.llm)
            if source is not None:
                apply_resolved(config.llm, source.resolve())
            backend = self._backend(config)
            with progress.phase(f"loading the draft model {name}"):
                return backend, backend.load()

        return load

    def load(self, slot: ModelSlot) -> None:
        """Load ``slot``'s model (fetching it first when it is a Hub id not yet cached) and start its
        engine; blocking, so the server runs it on a thread."""
        from llmserve.engine.client import EngineClient
        from llmserve.models.resolve import apply_resolved, plan_config_model
        from llmserve.server.serve import on_passing_thread

        source = plan_config_model(slot.config.llm)
        if source is not None:
            apply_resolved(slot.config.llm, source.resolve())
            slot.names = slot.names or list(slot.config.llm.served_model_name)
        engine = on_passing_thread(lambda: self._engine(slot))
        slot.metrics.resize(engine.max_model_len)
        engine.metrics = slot.metrics  # before the loop starts: the engine thread records into it
        slot.engine = EngineClient(engine)  # from here on the slot serves
