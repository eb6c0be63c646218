"""What the engine tells the rest of the server about itself: ``EngineStats``, one consistent
snapshot of its counters, read by anyone; and ``EngineObserver``, the events it reports as they
happen, to one observer that the server attaches.

The engine thread builds a fresh snapshot at the end of every loop iteration and publishes it
with one reference assignment, so the event loop (admission control, ``/metrics``, MindIE's
batch size) reads numbers that all come from the same moment, without locks and without
reaching into the scheduler or the block manager.

Per-request and per-step events (latencies, tokens per step) do not fit a snapshot: the engine
calls its observer for each. The observer is declared here, in the engine's own terms, so the
engine never imports the server; the server's Prometheus ``Metrics`` implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from llmserve.outputs import Timings


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine reports about itself (``EngineClient.stats()``).

    Sequence counts are the scheduler's after the latest step; token, prefix-cache and
    preemption numbers are totals since start.
    """

    running: int = 0                    # sequences in the running batch
    waiting: int = 0                    # sequences waiting to be scheduled
    dead: bool = False                  # the engine loop died; nothing will run any more
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0      # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0          # ... and found there
    preemptions: int = 0                # sequences preempted (blocks reclaimed, recomputed later)
    prompt_tokens: int = 0              # prompt tokens of finished requests
    generation_tokens: int = 0          # generated tokens
    steps: int = 0                      # backend steps run
    block_size: int = 0                 # tokens per KV block (0: no model yet)
    prefix_caching: bool = False        # whether KV blocks of shared prefixes are reused
    cache_dtype: str = "auto"           # --kv-cache-dtype as configured
    spec_drafts: int = 0                # decode steps of a sequence that verified proposed tokens
    spec_draft_tokens: int = 0          # tokens proposed in them
    spec_accepted_tokens: int = 0       # ... that the model's own samples confirmed
    spec_accepted_per_pos: tuple[int, ...] = ()  # confirmed proposals by position (0: the first proposed)
    state_slots_used: int = 0           # recurrent-state slots held by running sequences (hybrid models)
    state_slots_total: int = 0          # ... allocated (0: the model keeps no recurrent state)
    encoder_queries: int = 0            # request images looked up in the backend's encoder cache
    encoder_hits: int = 0               # ... whose features it held (not encoded again)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use (0 to 1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineObserver(Protocol):
    """What the engine reports while it runs (``LLMEngine.metrics``; the server attaches its
    ``llmserve.server.metrics.Metrics`` before the engine loop starts; None: nobody listens).

    Every method is called on the engine thread, in the middle of a step, for every request or
    every step: an implementation must return at once, never block and take no lock the event
    loop may hold (plain counters and histograms). Times are ``time.time()`` seconds.
    """

    def token_step(self, seconds: float) -> None:
        """One output step of a request went out, ``seconds`` after its previous one (not
        called for a request's first output step: that one is in its ``Timings``)."""

    def iteration(self, tokens: int) -> None:
        """One engine step ran ``tokens`` tokens through the model (prompt chunks and decodes
        together)."""

    def request_finished(self, reason: str, timings: Timings, prompt_tokens: int, generation_tokens: int,
                         now: float | None = None, n: int = 1, max_tokens: int | None = None,
                         preemptions: int = 0) -> None:
        """A generate request ended. ``reason`` is its finish reason (``stop``, ``length``,
        ``abort``, ``error``); ``timings`` its arrival, first schedule, first token and end;
        ``prompt_tokens`` / ``generation_tokens`` its token counts (all choices together);
        ``now`` when it ended (None: now); ``n`` and ``max_tokens`` its parameters;
        ``preemptions`` how often its sequences were preempted."""
