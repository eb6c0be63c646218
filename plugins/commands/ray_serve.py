"""Replicas on Ray Serve: ``llmserve ray-serve`` runs N full servers behind Ray's HTTP proxy.

Each replica is one Ray actor holding a whole llmserve server: the engine, the KV pool and
every enabled dialect, built by the same ``build_server`` as ``llmserve serve``. Ray does
the rest: its proxy routes requests to replicas, its controller scales them
(``--min-replicas``/``--max-replicas``) and calls each replica's ``check_health``, which
fails once the engine has died, so Ray replaces the replica; a replica process that dies is
restarted the same way. llmserve writes no router.

Ray is an optional extra (``pip install llmserve[ray]``): it is imported only when the
command runs, so ``import llmserve`` stays light.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, MutableMapping, Optional

import typer

from llmserve import CONFIG_OPTION, fail, resolve_config

if TYPE_CHECKING:
    from llmserve import ServerConfig
    from llmserve import ServerContext

log = logging.getLogger("llmserve.ray")

APP_NAME = "llmserve"
# Every response of a replica carries this header: which replica answered (Ray's id for it).
REPLICA_HEADER = "x-llmserve-replica"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

# Settings that belong to a server's own socket. Under Ray the proxy owns the socket: these
# would be silently ignored, so they are refused instead (Ray's proxy has its own options).
_PROXY_OWNED = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "root_path")


@dataclass
class RayOptions:
    """How many replicas, how Ray scales them and what each one reserves."""

    replicas: int = 1
    min_replicas: Optional[int] = None
    max_replicas: Optional[int] = None
    target_ongoing_requests: Optional[float] = None
    max_ongoing_requests: Optional[int] = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    health_check_period: float = 10.0
    address: Optional[str] = None


def deployment_options(config: "ServerConfig", options: RayOptions) -> dict[str, Any]:
    """The ``serve.deployment`` keyword arguments for ``options``.

    A replica takes up to ``--max-num-seqs`` requests at once (one engine batch); Ray's proxy
    holds the rest and hands them to whichever replica frees up first. With
    ``--max-replicas`` the replica count is Ray's autoscaler's, aiming at
    ``--target-ongoing-requests`` requests per replica (default: half a batch).
    """
    max_ongoing = options.max_ongoing_requests or config.scheduler.max_num_seqs
    out: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing,
        "ray_actor_options": {"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        "health_check_period_s": options.health_check_period,
        # A replica takes as long as its model load to start; Ray's default waits are for
        # small Python classes.
        "health_check_timeout_s": max(30.0, options.health_check_period * 3),
        # Ray's graceful stop of a replica is llmserve's drain: in-flight requests finish first.
        "graceful_shutdown_timeout_s": float(config.limits.shutdown_timeout),
    }
    if options.max_replicas is not None:
        low = options.replicas if options.min_replicas is None else options.min_replicas
        if not 0 <= low <= options.max_replicas:
            raise ValueError(f"--min-replicas ({low}) must be between 0 and --max-replicas ({options.max_replicas})")
        initial = min(max(options.replicas, low), options.max_replicas)
        out["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": options.max_replicas, "initial_replicas": initial,
            "target_ongoing_requests": options.target_ongoing_requests or max(1.0, max_ongoing / 2)}
    else:
        if options.min_replicas is not None or options.target_ongoing_requests is not None:
            raise ValueError("--min-replicas and --target-ongoing-requests need --max-replicas (autoscaling)")
        if options.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        out["num_replicas"] = options.replicas
    return out


def with_replica_header(app: ASGIApp, replica: str) -> ASGIApp:
    """``app`` with ``REPLICA_HEADER: replica`` on every HTTP response.

    The app's own ``x-request-id`` is dropped: Ray's proxy gives each request an id (the
    client's, when it sent one), passes it to the app, which adopts it, and adds it to the
    response itself, so it would otherwise arrive twice.
    """
    header = (REPLICA_HEADER.encode(), replica.encode("latin-1", "replace"))

    async def wrapped(scope: Scope, receive: Callable[[], Awaitable[Message]],
                      send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, header]}
            await send(message)

        await app(scope, receive, send_tagged)

    return wrapped


class _Built:
    """The app that this process's replica built: Ray asks for it through ``_replica_app``.

    Ray's ASGI ingress takes a builder with no arguments, called once the deployment class's
    constructor has run, so the constructor leaves its app here (one replica per actor process).
    """

    app: Optional[ASGIApp] = None


def _replica_app() -> ASGIApp:
    assert _Built.app is not None, "the replica's constructor builds the app first"
    return _Built.app


class LLMServeReplica:
    """One replica: a whole llmserve server (engine + dialects) inside a Ray actor.

    Ray runs the app's lifespan (readiness on, engine shut down at the end) and calls
    ``check_health`` every ``health_check_period_s``.
    """

    def __init__(self, config: "ServerConfig") -> None:
        from ray import serve

        from llmserve import PluginManager
        from llmserve import build_server, setup_logging

        setup_logging(config.log_level)
        app, self.context = build_server(config, PluginManager().load())
        replica = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s loaded %s", replica, self.context.model_name)
        _Built.app = with_replica_header(app, replica)

    def check_health(self) -> None:
        """Raise when the engine has died: Ray then replaces this replica."""
        context: "ServerContext" = self.context
        engine = context.engine
        if engine is None or engine.is_dead:
            raise RuntimeError("the llmserve engine of this replica died")


def build_application(config: "ServerConfig", options: RayOptions) -> Any:
    """The Ray Serve application: ``LLMServeReplica`` as an ASGI ingress, bound to ``config``."""
    from ray import serve

    for field in _PROXY_OWNED:
        if getattr(config.http, field):
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"{flag} is not used under Ray Serve: Ray's HTTP proxy owns the socket "
                             "(terminate TLS in front of it)")
    ingress = serve.ingress(_replica_app)(LLMServeReplica)
    deployment = serve.deployment(name="LLMServeReplica", **deployment_options(config, options))(ingress)
    return deployment.bind(config)


def replica_error(serve: Any) -> str | None:
    """The last line of the error a failed replica raised (a ``ConfigError``'s message, say),
    from Ray Serve's status of the deployment."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
    except (KeyError, AttributeError):
        return None
    for status in deployments:
        lines = [line.strip() for line in (status.message or "").splitlines() if line.strip()]
        if lines:  # "llmserve.errors.ConfigError: model path ... does not exist": the message alone
            last = lines[-1]
            return last.split(": ", 1)[1] if last.startswith("llmserve.") and ": " in last else last
    return None


def run(config: "ServerConfig", options: RayOptions) -> int:
    """Deploy the replicas on Ray (a local instance unless ``options.address``), serve on
    ``config.http.host:config.http.port`` through Ray's proxy until SIGINT or SIGTERM, then take the
    application down (and the local Ray instance, when this command started it)."""
    import ray
    from ray import serve

    from llmserve import setup_logging

    setup_logging(config.log_level)
    application = build_application(config, options)  # option errors before Ray starts
    ray.init(address=options.address, include_dashboard=False, logging_level=logging.WARNING)
    serving, stop = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not serving.is_set():
            raise KeyboardInterrupt  # still deploying (a long load, or no room for a replica): stop now
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": config.http.host, "port": config.http.port})
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # Ray's "Deploying application failed": say why in one line
            raise ValueError(f"the replicas did not start: {replica_error(serve) or exc}") from None
        serving.set()
        replicas = (f"{options.replicas} replica(s)" if options.max_replicas is None
                    else f"{options.min_replicas if options.min_replicas is not None else options.replicas}"
                         f"-{options.max_replicas} replicas (autoscaling)")
        # One line that scripts (and the tests) wait for.
        http = config.http
        print(f"llmserve: {replicas} serving at http://{http.host}:{http.port} through Ray Serve", flush=True)
        while not stop.wait(1.0):
            pass
        log.info("stopping: deleting the Ray Serve application")
        serve.delete(APP_NAME)
        if options.address is None:
            serve.shutdown()
    except KeyboardInterrupt:
        log.warning("stopped before the replicas were up")
        if options.address is not None:  # a shared cluster keeps running: take our application off it
            serve.delete(APP_NAME)
        return 130
    finally:
        ray.shutdown()
    return 0


REPLICAS = typer.Option(1, "--replicas", min=1, help="Replicas to run (the initial count when autoscaling).")
MIN_REPLICAS = typer.Option(None, "--min-replicas", min=0, help="Autoscaling floor (needs --max-replicas).")
MAX_REPLICAS = typer.Option(None, "--max-replicas", min=1,
                            help="Autoscaling ceiling: Ray scales between --min-replicas and this.")
TARGET_ONGOING = typer.Option(None, "--target-ongoing-requests", min=0.1,
                              help="Requests per replica the autoscaler aims at (default: half of --max-num-seqs).")
MAX_ONGOING = typer.Option(None, "--max-ongoing-requests", min=1,
                           help="Requests Ray sends one replica at once (default: --max-num-seqs).")
REPLICA_CPUS = typer.Option(1.0, "--replica-cpus", min=0.0, help="CPUs Ray reserves for each replica.")
REPLICA_GPUS = typer.Option(0.0, "--replica-gpus", min=0.0, help="GPUs Ray reserves for each replica.")
HEALTH_PERIOD = typer.Option(10.0, "--health-check-period", min=0.1,
                             help="Seconds between Ray's health checks of each replica.")
RAY_ADDRESS = typer.Option(None, "--ray-address",
                           help="Ray cluster to join ('auto' or host:port); default: start a local one.")


def ray_serve_command(model_arg: Optional[str] = typer.Argument(
                          None, metavar="MODEL", show_default=False,
                          help="Model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)."),
                      config: Optional[Path] = CONFIG_OPTION, replicas: int = REPLICAS,
                      min_replicas: Optional[int] = MIN_REPLICAS, max_replicas: Optional[int] = MAX_REPLICAS,
                      target_ongoing_requests: Optional[float] = TARGET_ONGOING,
                      max_ongoing_requests: Optional[int] = MAX_ONGOING, replica_cpus: float = REPLICA_CPUS,
                      replica_gpus: float = REPLICA_GPUS, health_check_period: float = HEALTH_PERIOD,
                      ray_address: Optional[str] = RAY_ADDRESS, *, flags: dict[str, Any]) -> None:
    """Serve replicas of the model behind Ray Serve's HTTP proxy (needs the `ray` extra).

    Takes every `serve` flag. Each replica is a whole server with every enabled dialect; Ray
    routes requests, health-checks and restarts replicas, and autoscales with --max-replicas.
    """
    if importlib.util.find_spec("ray") is None:
        fail("llmserve ray-serve needs Ray Serve: pip install 'llmserve[ray]'")
    if model_arg is not None:
        if flags.get("model") not in (None, model_arg):
            fail(f"the model is given twice, as the MODEL argument ({model_arg!r}) and as --model "
                 f"({flags['model']!r}); give one")
        flags["model"] = model_arg
    cfg, _ = resolve_config(flags, config)
    options = RayOptions(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                         target_ongoing_requests=target_ongoing_requests, max_ongoing_requests=max_ongoing_requests,
                         replica_cpus=replica_cpus, replica_gpus=replica_gpus,
                         health_check_period=health_check_period, address=ray_address)
    try:
        code = run(cfg, options)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(code)
