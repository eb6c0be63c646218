"""The per-HTTP-request record behind the one-line request log.

The HTTP middleware opens a ``RequestRecord`` in a context variable; the engine client adds
token counts and timings to it when a generation finishes (``note_output``), whichever
dialect made the call. Only numbers and ids go in: never prompts, outputs or headers.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None          # seconds from engine arrival to the first token
    engine_id: str | None = None       # the first engine request id seen


current: ContextVar[RequestRecord | None] = ContextVar("llmserve_request_record", default=None)


def note_output(out: Any) -> None:
    """Add a finished ``RequestOutput``'s counts to the current record (no-op outside HTTP)."""
    record = current.get()
    if record is None:
        return
    record.prompt_tokens += out.usage.prompt_tokens
    record.completion_tokens += out.usage.completion_tokens
    if record.engine_id is None:
        record.engine_id = out.request_id
    t = out.timings
    if t.first_token is not None and t.arrival:
        ttft = t.first_token - t.arrival
        record.ttft = ttft if record.ttft is None else min(record.ttft, ttft)
