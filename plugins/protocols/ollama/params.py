"""Ollama request fields -> the core's terms: model names (``name:tag``), ``options`` ->
``SamplingParams``, ``format`` -> ``GuidedSpec``, ``think``, and the reply's timing fields.

docs/ollama.md has the parameter table this module implements: which options are honoured,
which are accepted and ignored, which are refused.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from typing import Any

from llmserve import InvalidRequestError
from llmserve import GuidedSpec
from llmserve import RequestPolicy
from llmserve import SamplingParams

from .wire import Format, Options, Think

#: Ollama's sampling defaults (its ``api.DefaultOptions``), used for options a request leaves out.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}
THINK_LEVELS = ("low", "medium", "high")
LATEST = ":latest"


def invalid(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def listed_name(served: str) -> str:
    """How a served name appears in ``/api/tags``: with a tag, ``:latest`` unless it has one."""
    return served if ":" in served.rsplit("/", 1)[-1] else served + LATEST


def resolve_model(context: Any, name: str | None, required: bool = True) -> str:
    """The served name ``name`` (``name[:tag]``) refers to, under the server's model-name rule
    (``ServerContext.check_model``): ``x:latest`` is ``x``; an unknown name is a 404 in
    Ollama's words unless the server serves one model and is not ``--strict-model-name``."""
    if not name:
        if required:
            raise invalid("model is required", "model")
        return context.model_name
    if context.is_served(name):
        return context.check_model(name)
    bare = name[: -len(LATEST)] if name.endswith(LATEST) else name
    return context.check_model(bare, message=f'model "{name}" not found, try pulling it first')


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: Any) -> float | None:
    """``keep_alive`` in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1m");
    negative means "keep loaded", 0 "unload when done"; None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise invalid(f'keep_alive: "{text}" is not a duration (e.g. "5m", "1h", 300, 0 or -1)', "keep_alive")
    negative = text.startswith("-")
    total = sum(abs(float(n)) * _UNIT_SECONDS[u] for n, u in parts)
    return -total if negative else total


def _stops(value: list[str] | str | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if any(s == "" for s in stops):
        raise invalid("options.stop: stop sequences must not be empty strings", "options.stop")
    return stops


# The core's sampling fields as Ollama's options name them.
_OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}
OPTION_NAMES = {field: "options." + _OLLAMA_NAMES.get(field, field) for field in SamplingParams.model_fields}


def policy(options: Options | None, prompt: str) -> RequestPolicy:
    """How a request is prepared: errors name ``options.*`` and ``prompt`` (``messages`` for a
    chat); the output is capped to the room the prompt leaves in ``num_ctx`` (at most the
    server's context), as Ollama does."""
    o = options or Options()
    if o.num_ctx is not None and o.num_ctx < 1:
        raise invalid("options.num_ctx must be at least 1", "options.num_ctx")
    return RequestPolicy(prompt=prompt, names=OPTION_NAMES, length="cap", context_limit=o.num_ctx,
                         limit_param="options.num_ctx")


def sampling(options: Options | None) -> SamplingParams:
    """``options`` as SamplingParams. ``num_predict`` -1 or -2 (and absent) leave ``max_tokens``
    unset: the core's ``cap`` length policy makes it the room left in the context
    (``policy``), as it caps a larger ``num_predict``."""
    o = options or Options()
    if o.num_predict is None or o.num_predict in (-1, -2):
        max_tokens = None
    elif o.num_predict > 0:
        max_tokens = o.num_predict
    else:
        raise invalid("options.num_predict must be a positive number of tokens, or -1 (until the context is full)",
                      "options.num_predict")
    repeat = DEFAULTS["repeat_penalty"] if o.repeat_penalty is None else o.repeat_penalty
    presence, frequency = o.presence_penalty, o.frequency_penalty
    if o.repeat_last_n == 0:  # Ollama: a window of 0 tokens disables the repetition penalties
        repeat, presence, frequency = 1.0, None, None
    return SamplingParams.build(
            OPTION_NAMES, temperature=DEFAULTS["temperature"] if o.temperature is None else o.temperature,
            top_k=DEFAULTS["top_k"] if o.top_k is None else o.top_k,
            top_p=DEFAULTS["top_p"] if o.top_p is None else o.top_p,
            min_p=o.min_p, typical_p=o.typical_p,
            repetition_penalty=repeat, presence_penalty=presence, frequency_penalty=frequency,
            seed=o.seed if o.seed is not None and o.seed >= 0 else None,  # Ollama: -1 is a random seed
            stop=_stops(o.stop), max_tokens=max_tokens)


def guided_spec(fmt: Format) -> GuidedSpec | None:
    """``format``: "" / null (free text), "json" (a JSON object, as in Ollama), or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return GuidedSpec("json_object", None, param="format")
    if isinstance(fmt, dict):
        return GuidedSpec("json_schema", fmt, param="format")
    raise invalid(f'invalid format: expected "json" or a JSON schema, got {str(fmt)[:40]!r}', "format")


def think_mode(think: Think, reasoning_parser: str | None, model: str) -> bool | None:
    """True: thinking asked for (the server must have a reasoning parser); False: asked off;
    None: not said (the server's parser, if any, separates thinking as on every route)."""
    if think is None:
        return None
    if isinstance(think, str):
        if think not in THINK_LEVELS:
            raise invalid(f'invalid think value: {think[:20]!r} (must be "high", "medium", "low", true, or false)',
                          "think")
        think_on = True
    else:
        think_on = bool(think)
    if think_on and not reasoning_parser:
        raise invalid(f'"{model}" does not support thinking: start the server with --reasoning-parser', "think")
    return think_on


def template_kwargs(think: Think) -> dict[str, Any]:
    """What ``think`` tells the chat template (Qwen3-style ``enable_thinking``, and the level)."""
    if think is None:
        return {}
    out: dict[str, Any] = {"enable_thinking": think is not False}
    if isinstance(think, str):
        out["reasoning_effort"] = think
    return out


def check_unsupported(body: Any) -> None:
    """Fields the served model cannot honour: a clear 400 each."""
    if getattr(body, "logprobs", None):
        raise invalid("logprobs are not supported by this server's Ollama API (use the OpenAI API's logprobs)",
                      "logprobs")
    if getattr(body, "top_logprobs", None):
        raise invalid("top_logprobs is not supported by this server's Ollama API", "top_logprobs")


def created_at() -> str:
    """Now, as Ollama writes it: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def durations(started: float, timings: Any) -> dict[str, int]:
    """The timing fields of a final object, in nanoseconds. ``started`` is the route's
    ``time.time()``; ``timings`` the engine's (scheduled, first token, finished)."""
    end = time.time()
    scheduled = timings.scheduled or started
    first = timings.first_token or end
    finished = timings.finished or end
    ns = 1_000_000_000
    return {"total_duration": int(max(0.0, end - started) * ns), "load_duration": 0,
            "prompt_eval_duration": int(max(0.0, first - scheduled) * ns),
            "eval_duration": int(max(0.0, finished - first) * ns)}
