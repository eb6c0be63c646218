"""Streamed output events and usage: what the engine hands back to every dialect."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class TokenLogprob:
    """One token's log-probability and its top alternatives as ``(token_id, logprob)`` pairs;
    ``rank`` (1 = most likely) when the backend reports it (prompt tokens)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence (one of n) produced since the previous event.

    ``text`` is the new text only; concatenating every delta's text gives the full output.
    ``finish_reason`` is set on the sequence's last event; ``stop_reason`` then holds the
    matched stop string or stop token id, if that is why it stopped.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    num_tokens: int = 0


@dataclass(slots=True)
class Usage:
    """Token counts of a request. ``reasoning_tokens`` is counted by the engine for a request
    with a thinking budget (the tokens inside its reasoning); ``None`` when none was counted."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Timings:
    """Seconds since the epoch; None until the event happened."""

    arrival: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """One event of a request's stream.

    The first event carries ``prompt_token_ids`` (and ``prompt_logprobs`` when asked for);
    later events carry only deltas. ``finished`` is True on the last event, whose ``usage``
    holds the totals. ``error`` is set instead of deltas when the request failed.
    """

    request_id: str
    outputs: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    error: Exception | None = None
