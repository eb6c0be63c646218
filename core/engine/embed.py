"""The pooling path for embedding models (``--task embed``): batched, no KV cache, no decoding.

Requests queue token-id lists; the engine thread pools them in batches of at most
``--max-num-batched-tokens`` tokens at the start of its next step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from llmserve.engine.backend import Backend

log = logging.getLogger("llmserve.engine")
Done = Callable[[Any], None]


class EmbedQueue:
    """Token-id lists waiting to be pooled, each with the callback that gets its vectors."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.pending: list[tuple[list[list[int]], Done]] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, inputs: list[list[int]], done: Done) -> None:
        """Queue ``inputs``; ``done`` gets the vectors or an exception."""
        self.pending.append((inputs, done))

    def run(self, backend: Backend) -> int:
        """Pool everything queued; return how many prompt tokens were pooled."""
        pooled = 0
        while self.pending:
            batch: list[tuple[list[list[int]], Done]] = []
            tokens = 0
            while self.pending and (not batch or tokens + sum(map(len, self.pending[0][0])) <= self.budget):
                inputs, done = self.pending.pop(0)
                batch.append((inputs, done))
                tokens += sum(map(len, inputs))
            flat = [ids for inputs, _ in batch for ids in inputs]
            try:
                vectors = backend.embed(flat)
            except Exception as exc:  # fails these requests only
                log.exception("embedding batch failed")
                for _, done in batch:
                    done(exc)
                continue
            start = 0
            for inputs, done in batch:
                done(vectors[start:start + len(inputs)])
                start += len(inputs)
            pooled += tokens
        return pooled
