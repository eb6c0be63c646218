"""The Anthropic protocol: ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (in
``messages.py``) and Anthropic's error format.

Wire facts (see docs/anthropic.md): errors are ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's statuses (overload is 529 ``overloaded_error``, a server-side
timeout 504 ``timeout_error``); a stream's error after its 200 is an ``event: error`` frame with
the same body; the ``anthropic-version`` / ``anthropic-beta`` headers and the beta client's
``?beta=true`` query are accepted and change nothing; keys come as ``X-Api-Key`` (the SDK's
header) or ``Authorization: Bearer`` (the server's key check reads both).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from llmserve import (
    ContextLengthError,
    EngineDeadError,
    LLMServeError,
    ModelLoadingError,
    OverloadedError,
    RequestTimeoutError,
    ShuttingDownError,
)
from llmserve import dialect_router
from llmserve import SSE_RESPONSES
from llmserve import Protocol

from .messages import Messages
from .wire import AnthropicOptions, CountTokensRequest, MessagesRequest

# Anthropic's error type for each HTTP status it uses.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}


def error_status(error: LLMServeError) -> int:
    """The Anthropic status of a core error."""
    if isinstance(error, (OverloadedError, ShuttingDownError, ModelLoadingError)):
        return 529  # try again shortly (or on another replica): Anthropic's overload status
    if isinstance(error, RequestTimeoutError):
        return 504
    if isinstance(error, EngineDeadError) or error.status >= 500:
        return 500
    if error.status in ERROR_TYPES:
        return error.status
    return 400  # 405, 408 from a client, 415, 422...: the request is what is wrong


def error_body(error: LLMServeError) -> tuple[int, dict[str, Any]]:
    status = error_status(error)
    message = error.message
    if isinstance(error, ContextLengthError):  # Anthropic's words, which Claude Code parses to compact
        message = f"prompt is too long: {error.tokens} tokens > {error.limit} maximum"
    return status, {"type": "error", "error": {"type": ERROR_TYPES[status], "message": message}}


class AnthropicProtocol(Protocol):
    """Anthropic's Messages API."""

    error_schema = {"title": "AnthropicError", "type": "object", "required": ["type", "error"],
                    "properties": {"type": {"type": "string", "enum": ["error"]},
                                   "error": {"type": "object", "required": ["type", "message"],
                                             "properties": {"type": {"type": "string"},
                                                            "message": {"type": "string"}}}}}

    def __init__(self, context: Any, options: AnthropicOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or AnthropicOptions()

    def router(self) -> APIRouter:
        router = dialect_router(self, tags=["Anthropic"])
        messages = Messages(self)

        @router.post("/v1/messages", responses=SSE_RESPONSES,
                     summary="Anthropic Messages: a message, or an SSE stream of events when `stream` is true")
        async def create_message(body: MessagesRequest) -> Response:
            self.context.admission.check(1)  # before any templating or tokenizing
            return await messages.create(body)

        @router.post("/v1/messages/count_tokens", summary="Anthropic: input tokens of a Messages request")
        async def count_tokens(body: CountTokensRequest) -> Response:
            return await messages.count_tokens(body)

        return router

    def error_body(self, error: LLMServeError) -> tuple[int, dict[str, Any]]:
        return error_body(error)

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        """Anthropic's body, telling the SDK not to retry what cannot succeed on a retry."""
        response = super().error_response(error, request)
        if response.status_code < 500 and response.status_code != 429:
            response.headers["x-should-retry"] = "false"
        return response
