"""The base class of serving dialects (protocol plugins)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from fastapi import APIRouter, Request
    from starlette.responses import Response

    from llmserve.errors import LLMServeError
    from llmserve.server.context import ServerContext
    from llmserve.server.shared import SharedRoute


class Protocol(ABC):
    """A serving dialect: a FastAPI router plus the dialect's error format.

    Subclasses are contributed through ``register_protocols`` and built once per server with
    the shared ``ServerContext`` (config, engine client, model info) and the validated
    options of the dialect's YAML section (``None`` when the record declares no options).
    Routes translate the dialect's wire models to core requests (``GenerateRequest``),
    call ``context.engine.generate(...)`` and translate events back. Wire models live in the
    plugin, never in the core; ``llmserve.server.dialect_kit`` has the shared plumbing
    (``WireModel``, ``sse``, ``dialect_router``, ``in_band_errors``).

    Any exception raised while serving one of this protocol's routes reaches
    ``error_response``: core errors (``LLMServeError`` subclasses) as they are, request
    validation failures as ``InvalidRequestError`` naming the parameter, anything else as a
    ``GenerationError`` with a generic message (the traceback goes to the log only). A
    dialect states its format once, in ``error_body``; the default ``error_response`` sends
    that body with its status, and streams send the same body in-band once their 200 is gone.

    Example::

        class AcmeProtocol(Protocol):
            error_schema = {"type": "object", "required": ["acme_error"],
                            "properties": {"acme_error": {"type": "string"}}}

            def router(self):
                r = dialect_router(self)
                @r.post("/acme/generate")
                async def generate(body: AcmeRequest): ...
                return r

            def error_body(self, error):
                return error.status, {"acme_error": error.message}
    """

    #: JSON schema of this dialect's error body, declared as every route's 4XX/5XX response in
    #: the OpenAPI document. ``None`` means the OpenAI envelope (the default ``error_body``).
    error_schema: ClassVar[dict[str, Any] | None] = None
    #: The default ``error_body``'s ``code``: the status (False, vLLM's envelope) or, where the
    #: error has one, its name (True, OpenAI's: ``context_length_exceeded``, which clients key on).
    named_error_codes: ClassVar[bool] = False

    def __init__(self, context: "ServerContext", options: Any = None) -> None:
        self.context = context
        self.options = options

    @abstractmethod
    def router(self) -> "APIRouter":
        """Return the router with every route of this dialect."""

    def shared_routes(self) -> "list[SharedRoute]":
        """Routes this dialect shares with others, dispatched by body (see ``llmserve.server.shared``)."""
        return []

    def error_body(self, error: "LLMServeError") -> "tuple[int, dict[str, Any]]":
        """``(HTTP status, JSON body)`` of ``error`` in this dialect's format.

        Default: the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``
        with the error's own status; ``code`` is the status too, as vLLM sends it, or the error's
        own name for it (``context_length_exceeded``) where the dialect sets ``named_error_codes``,
        as OpenAI's API does. Streams whose 200 has gone send the body in-band
        (``dialect_kit.in_band_errors``).
        """
        from llmserve.server.errors import openai_error_body

        return error.status, openai_error_body(error, self.named_error_codes)

    def error_response(self, error: "LLMServeError", request: "Request | None") -> "Response":
        """Render ``error`` as this dialect's error reply: ``error_body`` as JSON, with
        ``Retry-After`` / ``WWW-Authenticate`` where the error calls for them. Override it
        to add headers (or for a reply that is not JSON)."""
        from starlette.responses import JSONResponse

        from llmserve.server.errors import error_headers

        status, body = self.error_body(error)
        return JSONResponse(body, status_code=status, headers=error_headers(error))
