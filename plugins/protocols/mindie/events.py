"""Engine events -> the MindIE family's reply fields, shared by the ``mindie`` and ``triton``
dialects: sequence 0's tokens and finish reason, and the timings (prefill_time, decode_time,
perf_stat, queue_wait_time, batch_size)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from llmserve import RequestOutput, SequenceDelta

if TYPE_CHECKING:
    from llmserve import EngineClient


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


def first_sequence(event: RequestOutput) -> tuple[list[int], str, str | None]:
    """Token ids, text and finish reason (MindIE's names) of sequence 0 in one engine event:
    the family's routes answer with one sequence."""
    ids: list[int] = []
    text, reason = "", None
    for d in event.outputs:
        if d.index == 0:
            ids += d.token_ids
            text += d.text
            reason = finish_reason(d) or reason
    return ids, text, reason


def running_batch(engine: "EngineClient") -> int:
    """How many sequences the engine is running now (the batch this request shares)."""
    return max(1, engine.stats().running)


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
