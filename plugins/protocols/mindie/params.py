"""Helpers shared by the ``triton`` and ``mindie`` dialects.

MindIE's Triton-style routes (``/v2/models/{m}/generate``, token ``/infer``) and its native
``/infer`` take the same family of ``parameters`` (temperature, top_k, top_p, do_sample,
seed, priority, timeout ...) with slightly different ranges, and report the same timing
fields (prefill_time, decode_time, perf_stat, queue_wait_time). This module holds the
pieces both plugins use: strict JSON body parsing with field-naming errors, an inline
OpenAPI schema for hand-parsed bodies, the MindIE sampling semantics, finish-reason names
and per-token timing bookkeeping. It is not a plugin itself (no hooks, no entry point).
"""

from __future__ import annotations

import functools
import json
import random
import time
from typing import Any, Awaitable, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.outputs import RequestOutput, SequenceDelta
from llmserve.sampling import SamplingParams
from llmserve.server.errors import to_error

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_INPUT_CHARS = 4 * 1024 * 1024          # "0KB < characters <= 4MB"
DEFAULT_MAX_NEW_TOKENS = 20
DEFAULT_PRIORITY = 5
DEFAULT_TIMEOUT = 600
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

M = TypeVar("M", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "bytes"}


class WireModel(BaseModel):
    """Request models: unknown fields are ignored, explicit nulls mean "default", and
    NaN/Infinity (which Python's json accepts) are rejected."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class MalformedBodyError(InvalidRequestError):
    """The body is not JSON, or not a JSON object (as opposed to a field with a bad value)."""


class UnsupportedError(LLMServeError):
    """A feature the dialect defines but this server does not implement. A 400, not a 501:
    the request asks for something this server cannot do, and retrying it will not help
    (Triton answers such requests with 400 too)."""

    status = 400
    type = "unsupported"


def guarded(protocol: Any, endpoint: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Render every exception of ``endpoint`` with ``protocol.error_response`` right here.

    Left to the app-wide handlers, an exception that is not an HTTPException reaches
    Starlette's ServerErrorMiddleware, which sends the error response but then re-raises:
    uvicorn logs a traceback and closes the keep-alive connection, so a client with a
    connection pool (tritonclient) fails its next call. ``functools.wraps`` keeps the
    signature FastAPI reads.
    """

    @functools.wraps(endpoint)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every error leaves in the dialect's format
            return protocol.error_response(to_error(exc), kwargs.get("request"))

    return wrapper


# -- request bodies ---------------------------------------------------------------------------
def load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError):
        raise MalformedBodyError("request body is not valid JSON") from None
    except RecursionError:
        raise MalformedBodyError("request body is nested too deeply") from None


def validation_error(exc: ValidationError, prefix: str = "") -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming the field (``a.b: msg``)."""
    err = exc.errors()[0]
    loc = []
    for part in err.get("loc", ()):
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            break  # pydantic names the union member it tried; the field is what users need
        loc.append(str(part))
    param = ".".join([prefix] + loc if prefix else loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


def parse_model(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate ``data`` (a parsed JSON value) as ``model``; errors name the field."""
    if not isinstance(data, dict):
        if prefix:
            raise InvalidRequestError(f"{prefix}: must be a JSON object", param=prefix)
        raise MalformedBodyError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from None


def parse_body(model: type[M], raw: bytes) -> M:
    return parse_model(model, load_json(raw))


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with every ``$ref`` inlined (our wire models are not
    recursive), usable directly in an OpenAPI ``requestBody``."""
    schema = model.model_json_schema()
    return _inline(schema, schema.get("$defs", {}))


def openapi_body(model: type[BaseModel], binary: bool = False) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body for a route that parses it by hand."""
    content: dict[str, Any] = {"application/json": {"schema": inline_schema(model)}}
    if binary:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}, "description": (
            "KServe binary tensor extension: the JSON header (length in the Inference-Header-Content-Length "
            "header) followed by the raw tensor bytes")}
    return {"requestBody": {"required": True, "content": content}}


# -- sampling ---------------------------------------------------------------------------------
def build_sampling(p: Any, prompt_len: int, max_model_len: int) -> tuple[SamplingParams, int | None]:
    """MindIE parameters -> (SamplingParams, seed to report).

    ``do_sample=false`` is greedy; ``do_sample=true`` samples; when ``do_sample`` is absent,
    sampling is on only if a sampling parameter (temperature, top_k, top_p, typical_p) moves
    away from its neutral value (TGI's rule, which MindIE follows: "decided by the other
    post-processing parameters"). A sampled request without a seed gets a random one, which
    is what the reply's ``details.seed`` reports. ``max_new_tokens`` (default 20) is capped to
    the room left in the context, as MindIE caps it to maxIterTimes.
    """
    temperature = p.temperature
    top_k = getattr(p, "top_k", None)
    top_p = getattr(p, "top_p", None)
    typical_p = getattr(p, "typical_p", None)
    do_sample = p.do_sample
    if do_sample is None:
        do_sample = ((temperature is not None and temperature != 1.0) or bool(top_k)
                     or (top_p is not None and top_p < 1.0) or (typical_p is not None and typical_p < 1.0))
    seed = p.seed
    if do_sample and seed is None:
        seed = random.randint(1, INT32_MAX)
    max_tokens = p.max_new_tokens if p.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    room = max_model_len - prompt_len
    if room > 0:
        max_tokens = min(max_tokens, room)
    sampling = SamplingParams.build(
        temperature=(temperature if temperature is not None else 1.0) if do_sample else 0.0,
        top_k=top_k or None, top_p=top_p, typical_p=typical_p,
        repetition_penalty=p.repetition_penalty, seed=seed, max_tokens=max_tokens)
    return sampling, seed


def deadline(timeout: int | float | None) -> float:
    return time.time() + (DEFAULT_TIMEOUT if timeout is None else timeout)


def priority(value: int | None) -> int:
    return DEFAULT_PRIORITY if value is None else value


def finish_reason(delta: SequenceDelta) -> str | None:
    """Engine reasons -> MindIE/TGI names: eos_token, stop_sequence, length."""
    reason = delta.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return "eos_token" if delta.stop_reason is None else "stop_sequence"
    if reason == "length":
        return "length"
    return "stop_sequence"  # aborted: MindIE's "request was cancelled or stopped"


def running_batch(engine: Any) -> int:
    """How many sequences the engine is running now (the batch this request shares)."""
    scheduler = getattr(getattr(engine, "engine", None), "scheduler", None)
    try:
        return max(1, int(scheduler.num_running))
    except (AttributeError, TypeError, ValueError):
        return 1


# -- timings ----------------------------------------------------------------------------------
def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(max(seconds, 0.0) * 1000.0, 2)


class TokenClock:
    """Per-token costs for perf_stat / prefill_time / decode_time from engine events.

    The first token's cost is the time to first token (``timings.first_token -
    timings.arrival``); each later token's cost is the gap since the previous event (split
    evenly when one event carries several tokens).
    """

    def __init__(self) -> None:
        self.perf: list[list[int]] = []      # [[token_id, ms], ...]
        self.last: float | None = None
        self.prefill_ms: float | None = None
        self.decode_s = 0.0
        self.batch = 1                       # running sequences at the latest event
        self.max_batch = 1                   # ... and the most seen over the request

    def add(self, event: RequestOutput, token_ids: list[int], engine: Any = None) -> tuple[float | None, float | None]:
        """Record one event; return ``(prefill_time_ms, decode_time_ms)`` for it (one is None)."""
        now = time.time()
        t = event.timings
        if engine is not None:
            self.batch = running_batch(engine)
            self.max_batch = max(self.max_batch, self.batch)
        if self.last is None:
            first = t.first_token if t.first_token is not None else now
            cost = first - t.arrival
            self.prefill_ms = ms(cost)
            self.last = first
            per = [cost] + [0.0] * (len(token_ids) - 1)
            result = (self.prefill_ms, None)
        else:
            gap = max(now - self.last, 0.0)
            self.last = now
            self.decode_s += gap
            per = [gap / max(len(token_ids), 1)] * len(token_ids)
            result = (None, ms(gap))
        self.perf += [[tok, int(round(c * 1000))] for tok, c in zip(token_ids, per)]
        return result

    @staticmethod
    def queue_wait_us(event: RequestOutput) -> int:
        t = event.timings
        if t.scheduled is None:
            return 0
        return int(round(max(t.scheduled - t.arrival, 0.0) * 1e6))

    def decode_ms(self, event: RequestOutput) -> float:
        t = event.timings
        if t.finished is not None and t.first_token is not None:
            return ms(t.finished - t.first_token) or 0.0
        return ms(self.decode_s) or 0.0


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"
