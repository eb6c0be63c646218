"""Dialect-neutral errors raised by the core; each protocol maps them to its own wire format."""

from __future__ import annotations


class LLMServeError(Exception):
    """Base class of every error the core hands to a protocol.

    ``status`` is the HTTP status a dialect should use unless its own conventions say otherwise
    (TGI, for instance, answers validation errors with 422). ``param`` names the offending
    request field when there is one. Messages are written for end users: they never contain
    stack traces, file paths or memory addresses.
    """

    status: int = 500
    type: str = "server_error"
    #: A stable machine-readable name some dialects carry besides the status (OpenAI's ``code``).
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status


class InvalidRequestError(LLMServeError):
    """A request field has a bad value (HTTP 400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """The prompt (``tokens`` of it, or at least that many) does not fit the context of ``limit``
    tokens (HTTP 400). Dialects word it as their clients parse it: OpenAI's ``code``
    ``context_length_exceeded``, Anthropic's ``prompt is too long: N tokens > M maximum``."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, tokens: int, limit: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.tokens = tokens
        self.limit = limit


class NotFoundError(LLMServeError):
    """An unknown model or resource (HTTP 404)."""

    status = 404
    type = "not_found_error"


class UnauthorizedError(LLMServeError):
    """Missing or wrong API key (HTTP 401)."""

    status = 401
    type = "authentication_error"


class PayloadTooLargeError(LLMServeError):
    """The request body is over the configured limit (HTTP 413)."""

    status = 413
    type = "invalid_request_error"


class OverloadedError(LLMServeError):
    """Admission control refused the request (HTTP 503, Retry-After)."""

    status = 503
    type = "overloaded_error"


class EngineDeadError(LLMServeError):
    """The engine loop has died; every request fails until the process restarts (HTTP 503)."""

    status = 503
    type = "engine_dead_error"


class ModelLoadingError(EngineDeadError):
    """The model is still loading: every route but the probes answers this (HTTP 503, retry)."""

    type = "unavailable_error"


class GenerationError(LLMServeError):
    """A failure while generating one request; other requests are unaffected (HTTP 500)."""

    status = 500
    type = "generation_error"


class RequestTimeoutError(GenerationError):
    """The request ran past the server's ``--request-timeout`` and was aborted (HTTP 408)."""

    status = 408
    type = "timeout_error"


class ShuttingDownError(LLMServeError):
    """The server stopped before this in-flight request finished (HTTP 503)."""

    status = 503
    type = "unavailable_error"


class ConfigError(Exception):
    """Bad configuration or plugin set-up; the CLI prints the message as one line and exits."""


class PluginLoadError(ConfigError):
    """A plugin the user asked for could not be loaded, or two plugins claim one name."""
