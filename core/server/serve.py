"""Assemble a server from configuration: plugins -> backend -> engine -> protocols -> app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, TypeVar

from llmserve import progress
from llmserve.config import GuidedConfig, ServerConfig, load_options, unknown_key_message
from llmserve.hooks.records import ProtocolSpec, resolve
from llmserve.errors import ConfigError
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry
from llmserve.models.resolve import plan_config_model
from llmserve.parsing.service import AUTO, requested_parsers
from llmserve.server.context import ServerContext
from llmserve.server.memory import trim_when_idle
from llmserve.server.models import SlotLoader, add_models
from llmserve.server.startup import base_url, bind_socket, ready_summary
from llmserve.text.chat_template import server_template

log = logging.getLogger("llmserve.server")
T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a short-lived thread and return its result (or raise its exception).

    Model loading and KV-pool allocation run this way so that the main thread never runs a
    parallel region of the compute library. OpenMP (libgomp, under torch on Linux) keeps a
    pool of worker threads per thread that ran one; once the pooled workers outnumber the
    cores it stops spinning between regions, and every parallel region of an engine step
    then pays futex sleeps and wake-ups (a one-row decode step of SmolLM2 on 2 cores went
    from 21 to 40 ms). A thread that exits takes its pool with it, so the engine thread ends
    up the only owner of OpenMP workers.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="llmserve-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("llmserve").setLevel(level.upper())
    progress.install()  # a live line on a terminal, plain periodic lines in a log


class _NoQueryStrings(logging.Filter):
    """Drops the query string from uvicorn's access-log lines: a client may send a key as ``?api_key=``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def uvicorn_options(config: ServerConfig, app: Any = None) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments for ``config``: HTTP limits, keep-alive, logging,
    the proxy's path prefix and TLS. With ``app`` (the FastAPI app), refusals of request heads
    are in the format of the dialect that owns the requested path."""
    from llmserve.server.edge import edge_protocol
    from llmserve.server.middleware import head_refusals

    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _NoQueryStrings) for f in access.filters):
        access.addFilter(_NoQueryStrings())
    # uvicorn annotates timeout_keep_alive as int, but it only feeds a float timer: sub-second
    # values work (the tests use them), so the float goes through untouched.
    answer = head_refusals(app, config) if hasattr(app, "state") else None
    return {"http": edge_protocol(config, answer), "timeout_keep_alive": config.http.timeout_keep_alive,
            "log_level": config.http.uvicorn_log_level or config.log_level,
            "access_log": not config.http.disable_uvicorn_access_log, "root_path": config.http.root_path,
            "ssl_keyfile": config.http.ssl_keyfile, "ssl_certfile": config.http.ssl_certfile,
            "ssl_ca_certs": config.http.ssl_ca_certs, "ssl_cert_reqs": config.http.ssl_cert_reqs}


def check_tls(config: ServerConfig) -> None:
    """Refuse, before the model loads, TLS settings uvicorn would fail on with a traceback."""
    if not (config.http.ssl_keyfile or config.http.ssl_certfile):
        if config.http.ssl_ca_certs or config.http.ssl_cert_reqs:
            raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: give --ssl-certfile and --ssl-keyfile")
        return
    if not config.http.ssl_certfile:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile (the certificate to serve HTTPS with)")
    import ssl

    from uvicorn.config import create_ssl_context

    try:
        create_ssl_context(config.http.ssl_certfile, config.http.ssl_keyfile, None, ssl.PROTOCOL_TLS_SERVER,
                           config.http.ssl_cert_reqs, config.http.ssl_ca_certs, "TLSv1")
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot serve HTTPS with --ssl-certfile {config.http.ssl_certfile!r} and --ssl-keyfile "
                          f"{config.http.ssl_keyfile!r}: {exc}") from None


def plugin_options(config: ServerConfig, registry: Registry) -> dict[str, Any]:
    """The options of each contribution that has a YAML section, and of the selected backend.

    One path for every kind: ``load_options`` validates the section named after the record
    against its options model. The selected backend's options are always built; a backend's
    come from its environment variables and flags too (CLI > env > YAML > defaults), other
    contributions' from their YAML section only.
    """
    by_name = {entry.record.name: entry for _, entry in registry.records() if entry.record.options}
    wanted = dict.fromkeys([*config.plugin_sections, *config.plugin_flags])
    backend = registry.get("backend", config.llm.backend).record
    if backend.options:
        wanted[backend.name] = None
    out: dict[str, Any] = {}
    for section in wanted:
        entry = by_name.get(section)
        if entry is None or not entry.record.options:
            raise ConfigError(unknown_key_message(section, "the config file", list(by_name)))
        environ: dict[str, str] | None = None if entry.record.kind == "backend" else {}
        out[section], _ = load_options(section, resolve(entry.record.options), config, environ)
    return out


def enabled_protocols(config: ServerConfig, registry: Registry) -> list[str]:
    if config.http.protocols is None:
        records = [registry.get("protocol", n).record for n in registry.names("protocol")]
        return [r.name for r in records if isinstance(r, ProtocolSpec) and r.default_enabled]
    names = []
    for name in config.http.protocols:
        primary = registry.get("protocol", name).record.name
        if primary not in names:
            names.append(primary)
    return names


def build_server(config: ServerConfig, plugins: PluginManager) -> tuple[Any, ServerContext]:
    """Load plugins named by the config, the backend and the engine; return (app, context).

    Everything that can be checked without the model (plugins, options, protocols and their
    routes) is checked first, so configuration mistakes fail fast.
    """
    app, context, load = prepare_server(config, plugins)
    load()
    return app, context


def prepare_server(config: ServerConfig, plugins: PluginManager) -> tuple[Any, ServerContext, Callable[[], None]]:
    """``build_server`` up to the model: (app, context, load). The app already serves the probes;
    ``load()`` (blocking) loads the model, starts the engine and runs the startup hooks, after
    which ``context.engine`` is set and every route serves."""
    from llmserve.server.app import build_app

    for spec in config.plugins:
        plugins.load_spec(spec, "config")
    for spec in config.parsing.tool_parser_plugin:
        plugins.load_spec(spec, "--tool-parser-plugin")
    plugins.check()
    registry = Registry.collect(plugins)
    options = plugin_options(config, registry)
    # MODEL looked up now (a path, or a Hub id in the cache; offline, a miss fails here), fetched
    # in load() when missing: /ready says what is being fetched meanwhile.
    plan_config_model(config.llm)
    parsing = config.parsing
    detected = AUTO in requested_parsers(parsing)  # chosen from the chat template once the model is loaded
    for kind, name in (("tool_parser", parsing.tool_call_parser), ("reasoning_parser", parsing.reasoning_parser)):
        if name and name != AUTO:
            registry.get(kind, name)  # fail fast on a typo
    if config.guided.guided_decoding_backend != GuidedConfig.model_fields["guided_decoding_backend"].default:
        registry.get("guided_decoder", config.guided.guided_decoding_backend)  # an explicit choice must exist
    if (speculative := config.scheduler.speculative_config) is not None:
        registry.get("proposer", speculative.method)  # a typo fails before the model loads
    context = ServerContext(config=config, registry=registry, plugins=plugins)
    add_models(context)
    if not detected:
        log.debug("parsers: %s", context.parsing)  # loaded once, here: a parser that does not import fails now
    protocols = {name: registry.load("protocol", name)(context, options.get(name))
                 for name in enabled_protocols(config, registry)}
    pool = context.pool

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if context.engine is not None:  # loaded before the app started; else the loader sets it
            context.ready = True
            path = context.model.path if context.model is not None else "-"
            log.info("serving %s (%s) with protocols: %s", context.model_name, path, ", ".join(protocols))
        trimmer = asyncio.create_task(trim_when_idle(context, config.limits.heap_trim_interval))
        reaper = asyncio.create_task(pool.reap()) if pool.several else None
        try:
            yield
        finally:
            trimmer.cancel()
            if reaper is not None:
                reaper.cancel()
            context.ready = False
            try:
                plugins.hook.shutdown(context=context)
            finally:
                pool.shutdown()

    app = build_app(context, protocols, lifespan=lifespan)  # raises on route conflicts
    log.info("loading model with backend '%s'", config.llm.backend)
    chat_template = config.parsing.chat_template
    loader = SlotLoader(registry, options, server_template(chat_template) if chat_template else None, detected)
    loader.prepare(pool.default)  # the default model's backend now: its mistakes fail fast
    pool.loader = loader.load
    pool.configure(config.router.max_loaded_models, config.router.idle_unload_seconds)

    def load() -> None:
        loader.load(pool.default)  # from here on every route serves (the loading gate opens)
        client = context.engine
        assert client is not None
        for plugin_name, hook in plugins.impls("startup"):
            try:
                hook(context=context)
            except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback
                client.shutdown()
                raise ConfigError(f"startup hook of plugin '{plugin_name}' failed: {type(exc).__name__}: "
                                  f"{exc}") from None

    return app, context, load


def run_server(config: ServerConfig, plugins: PluginManager) -> int:
    """Build and run the server until it is stopped; return the process exit code."""
    from llmserve.server.lifecycle import serve

    started = time.monotonic()
    setup_logging(config.log_level)
    check_tls(config)
    # The port first: a taken one fails before anything loads. The model then loads while the
    # server already answers /health (200) and /ready (503 "loading").
    sock = bind_socket(config.http.host, config.http.port)
    try:
        app, context, load = prepare_server(config, plugins)
    except BaseException:
        sock.close()
        raise
    port = int(sock.getsockname()[1])
    log.info("listening on %s: GET /health answers now, GET /ready once the model is loaded",
             base_url(context, port))

    def ready() -> None:
        for line in ready_summary(context, app.state.protocols, port, time.monotonic() - started):
            log.info("%s", line)

    # Drains on SIGTERM; exits non-zero when the engine died or the load failed.
    return serve(app, context, sockets=[sock], load=load, on_ready=ready)
