"""Turning any exception into a core error, and the default (OpenAI-style) error body."""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from llmserve.errors import (
    GenerationError,
    InvalidRequestError,
    LLMServeError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    UnauthorizedError,
)

log = logging.getLogger("llmserve.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "bytes"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _clean(text: str) -> str:
    """Never show memory addresses to clients."""
    return _ADDRESS.sub("", text)


def validation_to_error(exc: RequestValidationError) -> InvalidRequestError:
    """FastAPI's body validation failure as an InvalidRequestError naming the field."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return InvalidRequestError("request body is not valid JSON")
    return field_error(errors)


def field_error(errors: Sequence[Any], prefix: str = "") -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming the field (``prefix.a.b: msg``).

    The one wording every dialect shows for a bad field, whether FastAPI validated the body
    (its locations start with ``body``) or a route validated a body it parsed itself.
    """
    if not errors:
        return InvalidRequestError("invalid request")
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    fields: list[str] = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break  # pydantic names the union member it tried; the field is what users need
        fields.append(str(part))
    if not fields and not prefix and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return InvalidRequestError("request body must be a JSON object")
    param = ".".join([prefix, *fields] if prefix else fields) or None
    msg = _clean(str(err.get("msg", "invalid value"))).removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


def to_error(exc: BaseException) -> LLMServeError:
    """Map any exception raised under a route to a core error a dialect can render."""
    if isinstance(exc, LLMServeError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_to_error(exc)
    if isinstance(exc, HTTPException):
        by_status = {401: UnauthorizedError, 404: NotFoundError, 413: PayloadTooLargeError,
                     503: OverloadedError}
        cls = by_status.get(exc.status_code, InvalidRequestError if exc.status_code < 500 else GenerationError)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        return cls(_clean(detail), status=exc.status_code)
    if isinstance(exc, RecursionError):
        # JSON text inside a field (a schema or tool arguments sent as a string), decoded past
        # Python's recursion limit: the request's nesting, not a server fault.
        log.warning("a request nested too deeply to process: %s", exc)
        return InvalidRequestError("request is nested too deeply (a JSON value inside a field, more than a few "
                                   "hundred levels)")
    log.exception("unhandled error while serving a request")
    return GenerationError("internal server error")


def openai_error_body(error: LLMServeError, named_codes: bool = False) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the OpenAI envelope. ``code`` is the
    status, as vLLM sends it, or with ``named_codes`` the error's own ``code`` where it has one
    (``context_length_exceeded``, which OpenAI's API sends and agent clients key on)."""
    code: int | str = error.code if named_codes and error.code else error.status
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": code}}


def openai_error_response(error: LLMServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI envelope with the error's status (paths no dialect owns answer with it)."""
    return JSONResponse(openai_error_body(error), status_code=error.status, headers=error_headers(error, headers))


def error_headers(error: LLMServeError, headers: dict[str, str] | None = None) -> dict[str, str]:
    out = dict(headers or {})
    if isinstance(error, OverloadedError):
        out.setdefault("Retry-After", "1")
    if isinstance(error, UnauthorizedError):
        out.setdefault("WWW-Authenticate", "Bearer")
    return out
