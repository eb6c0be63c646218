"""What every protocol receives: configuration, model info, the engine client and shared state."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmserve.config import ServerConfig
from llmserve.errors import InvalidRequestError, NotFoundError
from llmserve.request_context import current_context
from llmserve.server.admission import Admission
from llmserve.server.metrics import Metrics
from llmserve.server.pool import ModelNotLoaded, ModelPool, ModelSlot

# The longest model name a request may send (a Hub id is at most 193 characters; a served path
# may be longer), and the characters no name holds.
MAX_MODEL_NAME_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

if TYPE_CHECKING:  # names only: importing them here would pull the engine and pluggy in early
    from starlette.responses import StreamingResponse

    from llmserve.engine.backend import ModelInfo
    from llmserve.engine.client import EngineClient
    from llmserve.guided import GuidedDecoding
    from llmserve.hooks.manager import PluginManager
    from llmserve.hooks.registry import Registry
    from llmserve.parsing.service import ParsingService


@dataclass
class ServerContext:
    """Shared by all protocols of one server.

    ``engine`` is the asyncio engine client (``generate()``, ``abort()``, ``stats()``);
    ``model`` is the backend's ``ModelInfo``; both are None until the model has loaded. With
    several models (``pool``), both are those of the model the current request was routed to by
    ``check_model`` (the default model outside a request, or before routing).
    ``state`` is free for plugins (key it by plugin name).
    """

    config: ServerConfig
    registry: "Registry | None" = None
    plugins: "PluginManager | None" = None
    state: dict[str, Any] = field(default_factory=dict)
    # Readiness (GET /ready): ``ready`` turns on once the model is loaded and the app started;
    # set ``draining`` when shutting down so load balancers stop sending new requests.
    ready: bool = False
    draining: bool = False
    # Prometheus metrics (GET /metrics); admission control counts refusals with
    # ``context.metrics.rejected(reason)``.
    metrics: Metrics = field(default_factory=Metrics)
    # Admission control (``llmserve.server.admission``): generation routes call
    # ``context.admission.check(n)`` before any tokenizing or templating work.
    admission: "Admission" = field(init=False, repr=False)
    # The models served (``llmserve.server.pool``): the default one, and any loaded on demand.
    pool: ModelPool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self)
        self.pool = ModelPool(ModelSlot(names=list(self.config.llm.served_model_name), config=self.config,
                                        metrics=self.metrics))

    @property
    def slot(self) -> ModelSlot:
        """The model of the current request (the default one outside a request or before routing)."""
        ctx = current_context()
        chosen = getattr(ctx, "model", None)
        return chosen if isinstance(chosen, ModelSlot) else self.pool.default

    @property
    def model(self) -> "ModelInfo | None":
        return self.slot.model

    @model.setter
    def model(self, value: "ModelInfo | None") -> None:
        self.pool.default.model = value

    @property
    def engine(self) -> "EngineClient | None":
        return self.slot.engine

    @engine.setter
    def engine(self, value: "EngineClient | None") -> None:
        self.pool.default.engine = value

    def sse_response(self, body: Any, headers: dict[str, str] | None = None,
                     ping: str | None = None) -> "StreamingResponse":
        """A ``text/event-stream`` StreamingResponse over ``body`` with keep-alive pings
        (``: ping`` after every ``--sse-ping-interval`` silent seconds, or the dialect's own
        ``ping`` frame, e.g. Anthropic's ``event: ping``). Every SSE route uses it."""
        from starlette.responses import StreamingResponse

        from llmserve.server.keepalive import PING, with_pings

        return StreamingResponse(with_pings(body, self.config.limits.sse_ping_interval, ping or PING),
                                 media_type="text/event-stream", headers=headers)

    @property
    def guided(self) -> "GuidedDecoding":
        """The server's ``llmserve.guided.GuidedDecoding``, created on first use (after the
        model has loaded); decoders are built only when a request needs them."""
        slot = self.slot
        if slot.guided is None:
            from llmserve.guided import GuidedDecoding
            from llmserve.guided.bounds import GuidedLimits

            if slot.engine is None or slot.model is None:
                raise RuntimeError("guided decoding needs the loaded model")
            slot.guided = GuidedDecoding(self.registry, self.config.guided.guided_decoding_backend,
                                         slot.engine.tokenizer, slot.model.vocab_size, list(slot.model.eos_token_ids),
                                         limits=GuidedLimits.from_config(self.config.guided))
        return slot.guided

    @property
    def parsing(self) -> "ParsingService":
        """The server's ``llmserve.parsing.service.ParsingService``: its parser classes and
        tool-choice flag, resolved once (``prepare_server`` builds it at start)."""
        slot = self.slot
        if slot.parsing is None:
            from llmserve.parsing.service import ParsingService

            slot.parsing = ParsingService.from_config(self.config.parsing, self.registry)
        return slot.parsing

    def use_parsing(self, service: "ParsingService", slot: ModelSlot | None = None) -> None:
        """Install the parsers chosen once the model is known (``auto``: detected from its chat
        template, before the first request is served)."""
        (slot or self.pool.default).parsing = service

    def readiness(self) -> str | None:
        """None when the server should get traffic, else why not (loading, draining, engine dead)."""
        if self.draining:
            return "draining"
        if not self.ready or self.model is None or self.engine is None:
            return "loading"
        if self.engine.is_dead:
            return "engine dead"
        return None

    @property
    def served_model_names(self) -> list[str]:
        """The names of the current request's model (the default model's outside a request)."""
        slot = self.slot
        if slot.names:
            return list(slot.names)
        return [slot.model.name] if slot.model is not None else ["llmserve"]

    @property
    def model_name(self) -> str:
        """The name reported back to clients."""
        return self.served_model_names[0]

    def is_served(self, name: str) -> bool:
        """Whether ``name`` is one of the model's served names (or the path it was loaded from)."""
        return name in self.served_model_names or (self.model is not None and name == self.model.path)

    def check_model(self, name: str | None, param: str = "model", message: str | None = None) -> str:
        """The name to answer a request for model ``name`` under, or a 404 (``message``, or vLLM's).

        The one place every dialect resolves model names: a served name (or empty) is accepted;
        so is any other name while the server has one model with a single served name, as TGI and
        llama.cpp do, unless ``--strict-model-name``; otherwise an unknown one is a 404. With
        several models the request is routed to the one named (raising ``ModelNotLoaded`` when it
        must be loaded first: the route wrapper loads it and runs the route again)."""
        if name and not self.is_served(name) and (len(name) > MAX_MODEL_NAME_CHARS or _CONTROL.search(name)):
            # A name is only ever compared and echoed, never a path; an absurd one is still refused.
            raise InvalidRequestError(f"`{param}` must be a model name of at most {MAX_MODEL_NAME_CHARS} characters "
                                      f"without control characters (got {len(name)} characters)", param=param)
        pool = self.pool
        slot = pool.find(name) if name and pool.several else None
        if slot is not None:
            if slot.engine is None:
                raise ModelNotLoaded(slot)
            self._route(slot)
            return slot.name
        if not name or self.is_served(name) or (not pool.several and len(set(self.served_model_names)) == 1
                                                 and not self.config.llm.strict_model_name):
            return self.model_name
        raise NotFoundError(message or f"The model `{name}` does not exist.", param=param)

    def pull_model(self, text: str) -> ModelSlot:
        """Fetch the Hugging Face model ``text`` into the cache and serve it from now on, loaded on
        its first request (blocking: run it on a thread). Only with ``--allow-pull``."""
        from llmserve.errors import LLMServeError
        from llmserve.server.models import pull_slot

        if not self.config.router.allow_pull:
            raise LLMServeError("pulling models over HTTP is disabled on this server (--allow-pull)", status=403)
        return pull_slot(self, text)

    def keep_model_alive(self, seconds: float | None) -> None:
        """How long the current request's model may stay loaded once idle (Ollama's ``keep_alive``:
        0 unloads it when the request ends, a negative value keeps it; None: the server's rule).
        The default model always stays loaded."""
        ctx = current_context()
        if ctx is not None and seconds is not None:
            ctx.keep_alive = float(seconds)

    def _route(self, slot: ModelSlot) -> None:
        """Make ``slot`` the current request's model, holding a lease on it until the request ends."""
        ctx = current_context()
        if ctx is None or ctx.closed or ctx.model is slot:
            return
        if isinstance(ctx.model, ModelSlot):
            self.pool.release(ctx.model)
        ctx.model = slot
        self.pool.lease(slot)
