"""``EngineStats``: one consistent snapshot of the engine's counters, for the server to read.

The engine thread builds a fresh snapshot at the end of every loop iteration and publishes it
with one reference assignment, so the event loop (admission control, ``/metrics``, MindIE's
batch size) reads numbers that all come from the same moment, without locks and without
reaching into the scheduler or the block manager.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use (0 to 1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
