"""What a server does before and while its model loads: bind the port first, answer probes during
the load (other routes get 503 "loading" in their dialect's format), and say "ready" in one summary.

``llmserve serve`` binds its socket before it imports a backend, so a port that is taken fails at
once; uvicorn then serves on that socket while the model loads on a thread: ``/health`` answers
200 (alive) and ``/ready`` 503 ``loading`` until the engine runs.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from starlette.types import Receive, Scope, Send

from llmserve.errors import ConfigError, ModelLoadingError
from llmserve.server.middleware import PUBLIC_ATTR, Checks

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmserve.server.context import ServerContext

log = logging.getLogger("llmserve.server")
F = TypeVar("F", bound=Callable[..., Any])
WHILE_LOADING_ATTR = "__llmserve_while_loading__"
RETRY_AFTER_S = 5


def while_loading(endpoint: F) -> F:
    """Mark an endpoint that answers (itself) while the model loads: probes such as a dialect's
    own health routes. Routes marked ``public_route`` (``/health``, ``/ping``, ``/ready``,
    ``/metrics``) are served during the load as well."""
    setattr(endpoint, WHILE_LOADING_ATTR, True)
    return endpoint


class LoadingGate:
    """ASGI middleware: until ``context.engine`` exists, a request for a route that needs the model
    gets 503 with ``Retry-After`` in the format of the dialect that owns the route."""

    def __init__(self, app: Any, fastapi_app: "FastAPI", context: "ServerContext") -> None:
        self.app = app
        self.context = context
        self.checks = Checks(fastapi_app, context.config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.context.engine is not None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        _, endpoint = self.checks.match(scope)
        if endpoint is None or getattr(endpoint, PUBLIC_ATTR, None) or getattr(endpoint, WHILE_LOADING_ATTR, False):
            await self.app(scope, receive, send)  # unrouted (404) or a probe
            return
        error = ModelLoadingError("the model is still loading; retry once GET /ready answers 200")
        await self.checks.refuse(error, {"Retry-After": str(RETRY_AFTER_S)}, scope, endpoint, send)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, or a one-line ConfigError that says what to change."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot bind --host {host!r}: {exc.strerror}; use an address of this machine "
                          "(127.0.0.1, 0.0.0.0 or ::)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)  # clients that connect while uvicorn starts wait in the backlog
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"cannot listen on {where}: the port is already in use (is another server running?); "
                              "stop it or choose another port with --port") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"cannot listen on {where}: permission denied; use a port above 1023 or run with the "
                              "rights to bind it") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"cannot listen on {where}: the address is not one of this machine's; use 127.0.0.1, "
                              "0.0.0.0 or one of its own addresses with --host") from None
        raise ConfigError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def base_url(context: "ServerContext", port: int) -> str:
    """``http(s)://host:port`` clients reach this server at (a wildcard host shown as loopback)."""
    config = context.config
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(config.http.host, config.http.host)
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if config.http.ssl_certfile else "http"
    return f"{scheme}://{host}:{port}{config.http.root_path.rstrip('/')}"


def ready_summary(context: "ServerContext", protocols: dict[str, Any], port: int, seconds: float) -> list[str]:
    """The lines logged once the server is ready: the model, its limits, the KV pool and where each
    dialect answers."""
    info, engine, config = context.model, context.engine, context.config
    lines = [f"ready in {seconds:.1f} s"]
    if info is not None:
        notes = [n for n in ("read from GGUF" if str(info.path).lower().endswith(".gguf") else None,
                             getattr(info, "quantization", None)) if n]
        stored = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"  model    {context.model_name} ({info.path})")
        lines.append(f"  weights  {info.dtype} on {info.device}{stored}; context {info.max_model_len} tokens")
    inner = getattr(engine, "engine", None)
    blocks = getattr(getattr(inner, "block_manager", None), "num_blocks", None)
    if blocks and info is not None and info.task != "embed":
        kv, size = config.cache.kv_cache_dtype, config.cache.block_size  # kv auto: the model's compute dtype
        lines.append(f"  KV pool  {blocks} blocks x {size} tokens = {blocks * size} tokens "
                     f"in {info.dtype if kv == 'auto' else kv}")
    spec = config.scheduler.speculative_config
    if spec is not None and info is not None and info.task != "embed":
        draft = (spec.model_extra or {}).get("model")
        method = f"{spec.method} ({draft})" if draft else spec.method
        lines.append(f"  speculative decoding  {method}, up to {spec.num_speculative_tokens} proposed tokens "
                     "per sequence and step (acceptance: /metrics vllm:spec_decode_*)")
    others = [slot.name for slot in context.pool.slots if not slot.pinned]
    if others:
        lines.append(f"  models   {', '.join(others)} (loaded on their first request)")
    root = base_url(context, port)
    registry = context.registry
    for name in protocols:
        prefix = config.http.protocol_prefix.get(name, "").rstrip("/")
        described = ""
        if registry is not None:
            try:
                described = registry.get("protocol", name).record.description or ""
            except (ConfigError, KeyError):
                described = ""
        lines.append(f"  {name:<12} {root}{prefix}/  {described}".rstrip())
    return lines


def as_startup_error(exc: BaseException) -> ConfigError | None:
    """A load failure the user can act on, as one line (None: a bug, keep its traceback)."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return ConfigError(f"not enough memory to load the model and its KV pool ({first}): use a smaller model or "
                           "--dtype, fewer KV blocks (--num-kv-blocks / --kv-cache-memory-fraction) or a smaller "
                           "--max-model-len")
    return None
