"""``llmserve warmup``: do a first start's once-per-machine work ahead of time.

The backend is built as ``serve`` builds it and its ``warm_up()`` runs (the torch backend compiles
its native CPU kernels there and caches a GGUF model's config and tokenizer, or converts one it
cannot serve in its own quantization); a backend without one is loaded once and released. A
``serve`` of the same model afterwards finds every cache.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from llmserve.config import ServerConfig

if TYPE_CHECKING:
    from llmserve.hooks.manager import PluginManager

log = logging.getLogger("llmserve.warmup")


def warm_up(config: ServerConfig, plugins: "PluginManager") -> float:
    """Warm every cache a start of ``config`` uses; returns the seconds it took."""
    from llmserve.config import load_options
    from llmserve.hooks.records import resolve
    from llmserve.hooks.registry import Registry
    from llmserve.models.resolve import apply_resolved, plan_config_model
    from llmserve.server.serve import on_passing_thread, setup_logging

    setup_logging(config.log_level)
    started = time.monotonic()
    source = plan_config_model(config.llm)  # a Hub id: found in the cache or fetched into it first
    if source is not None:
        apply_resolved(config.llm, source.resolve())
    for spec in config.plugins:
        plugins.load_spec(spec, "config")
    registry = Registry.collect(plugins)
    record = registry.get("backend", config.llm.backend).record
    backend_cls = registry.load("backend", config.llm.backend)
    if record.options:
        options, _ = load_options(record.name, resolve(record.options), config)
        backend = backend_cls(config, options)
    else:
        backend = backend_cls(config)

    def run() -> None:
        warm = getattr(backend, "warm_up", None)
        if callable(warm):
            warm()
            return
        info = backend.load()  # a backend without its own warm-up: one load fills its caches
        log.info("loaded %s (%s) once", info.name, info.path)
        backend.close()

    on_passing_thread(run)
    took = time.monotonic() - started
    log.info("warm-up done in %.1f s: `llmserve serve` with the same model and options now starts from the caches",
             took)
    return took
