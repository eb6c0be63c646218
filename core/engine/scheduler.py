"""Unified token-budget scheduler: prefill chunks and decodes share each step (vLLM V1 style).

Pure bookkeeping on Sequences and the BlockManager; the scheduler never sees a tensor.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.sequence import Sequence, SequenceStatus
from llmserve.media.inputs import chunk_end


@dataclass(slots=True)
class ScheduledSeq:
    """Feed ``seq.token_ids[start : start + num_tokens]`` with ``start = seq.num_computed_tokens``;
    with ``drafts`` (proposed tokens, ``engine.speculation``), the newest token and then them."""

    seq: Sequence
    num_tokens: int
    sample: bool
    drafts: list[int] = field(default_factory=list)


def _rank(seq: Sequence) -> tuple[int, float, int]:
    # Lower ranks are served first and preempted last.
    return (seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    """Decides which sequences run each step and how many tokens each feeds.

    Engine loop contract, per step::

        batch = scheduler.schedule()        # then fail every seq in scheduler.unschedulable
        results = backend.step(...)         # feed batch[i].num_tokens tokens from num_computed_tokens
        scheduler.on_step_done(batch)       # FIRST: advance num_computed_tokens, cache blocks
        seq.append_token(tok)               # THEN: append each sampled token
        scheduler.finish(seq)               # for sequences that stopped

    Waiting sequences hold no blocks and no state slot (a failed admission gives its prefix hits
    back), so when nothing runs the whole pool is free; that is what makes ``unschedulable`` sound.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.running: list[Sequence] = []  # admission order: older sequences decode first
        # Heap ordered by rank plus a dict for membership: aborting a waiting sequence only
        # drops it from the dict, and its stale heap entry is skipped when it surfaces.
        self._waiting_heap: list[tuple[int, float, int, Sequence]] = []
        self._waiting: dict[int, Sequence] = {}
        self.num_preemptions_total = 0
        # Sequences that can never be scheduled (they need more blocks than the whole pool,
        # or more tokens than one step's budget with chunked prefill off). Filled by each
        # schedule() call; they are already FINISHED and freed, the engine reports the error.
        self.unschedulable: list[Sequence] = []

    # -- queues ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting[seq.seq_id] = seq
        heapq.heappush(self._waiting_heap, (*_rank(seq), seq))

    def _peek_waiting(self) -> Sequence | None:
        heap = self._waiting_heap
        while heap:
            seq = heap[0][3]
            if self._waiting.get(seq.seq_id) is seq:
                return seq
            heapq.heappop(heap)  # stale: aborted or finished while waiting
        return None

    def _pop_waiting(self, seq: Sequence) -> None:
        heapq.heappop(self._waiting_heap)
        del self._waiting[seq.seq_id]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Tokens the waiting sequences still have to (re)compute."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self._waiting.values())

    def waiting_seqs(self) -> list[Sequence]:
        return sorted(self._waiting.values(), key=_rank)

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}  # seq_id -> item, in scheduling order
        self.unschedulable = []
        preempted = False

        # 1. Running sequences: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n <= 0:  # nothing new to feed (engine did not append yet): skip this step
                i += 1
                continue
            if n == 1 and seq.draft and self._schedule_drafts(seq, budget, scheduled):
                budget -= scheduled[seq.seq_id].num_tokens
                i += 1
                continue
            if n > budget:
                if not self.enable_chunked_prefill:
                    i += 1
                    continue
                n = chunk_end(seq.media, seq.num_computed_tokens, seq.num_computed_tokens + budget) - \
                    seq.num_computed_tokens
            while not bm.allocate(seq, n):
                if len(self.running) == 1:  # alone with the whole pool and still short
                    self._mark_unschedulable(seq)
                    break
                victim = max(self.running, key=_rank)
                vi = self.running.index(victim)
                if victim.seq_id in scheduled:  # already in this step: give its budget back
                    budget += scheduled.pop(victim.seq_id).num_tokens
                self._preempt(victim)
                preempted = True
                if vi < i:
                    i -= 1
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens)
                budget -= n
                i += 1

        # 2. Waiting sequences, best rank first. Skipped after a preemption: the pool is
        # tight, and re-admitting what we just evicted would only thrash.
        while not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self._peek_waiting()
            if head is None:
                break
            seq = head
            # Prompt logprobs need every prompt position computed, so no prefix hits for them.
            cached = bm.match_prefix(seq) if seq.sampling.prompt_logprobs is None else 0
            seq.num_computed_tokens = cached
            remaining = seq.num_tokens - cached
            if not self.enable_chunked_prefill and remaining > self.max_num_batched_tokens:
                self._pop_waiting(seq)  # would never fit in any step
                self._mark_unschedulable(seq)
                continue
            n = chunk_end(seq.media, cached, cached + min(remaining, budget)) - cached
            if not self.enable_chunked_prefill and n < remaining:
                bm.free(seq)  # give the prefix hits back: waiting sequences hold no blocks
                break  # fits a later, emptier step
            if not bm.allocate(seq, n):
                bm.free(seq)
                if not self.running:
                    # Nothing else holds blocks (nor budget), yet this chunk does not fit:
                    # the sequence needs more than the whole pool and never will fit.
                    self._pop_waiting(seq)
                    self._mark_unschedulable(seq)
                    continue
                break  # keep it simple: never preempt running sequences for waiting ones
            self._pop_waiting(seq)
            bm.record_prefix_query(seq.num_tokens, cached)
            if seq.num_preemptions == 0:  # usage reports the first admission's hits only
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = ScheduledSeq(seq, n, cached + n == seq.num_tokens)
            budget -= n

        return list(scheduled.values())

    def _schedule_drafts(self, seq: Sequence, budget: int, scheduled: dict[int, ScheduledSeq]) -> bool:
        """Schedule ``seq``'s decode with its proposed tokens when the budget and free blocks
        allow (never by preempting another sequence: proposals are optional); else drop them."""
        drafts = seq.draft[: budget - 1]
        seq.draft = []
        if not drafts or not self.block_manager.allocate(seq, 1 + len(drafts)):
            return False
        scheduled[seq.seq_id] = ScheduledSeq(seq, 1 + len(drafts), True, drafts)
        return True

    def on_verified(self, seq: Sequence, accepted: int) -> None:
        """After a step that verified proposals: ``accepted`` of them (appended since as output
        tokens) have their KV in the cache too; the blocks held for the others go back."""
        if seq.status is not SequenceStatus.RUNNING:  # finished or aborted: blocks are gone
            return
        seq.num_computed_tokens += accepted
        self.block_manager.cache_computed_blocks(seq)
        self.block_manager.trim(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, queue it again."""
        self.running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens to 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.add(seq)

    def _mark_unschedulable(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.unschedulable.append(seq)

    def on_step_done(self, scheduled: list[ScheduledSeq]) -> None:
        """Advance computed tokens and publish newly full blocks to the prefix cache.

        Call before appending the sampled tokens, so ``num_computed_tokens`` refers to the
        tokens that were actually fed.
        """
        for item in scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted mid-step: blocks are gone
                continue
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.cache_computed_blocks(seq)

    # -- leaving -----------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks. Idempotent."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif self._waiting.get(seq.seq_id) is seq:
            del self._waiting[seq.seq_id]  # heap entry goes stale, skipped on peek
        if seq.block_table or seq.state_slot is not None:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, seq: Sequence) -> None:
        """Same as finish(): works whether ``seq`` is waiting, running or already gone."""
        self.finish(seq)

    # -- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} in running list"
        for seq in self._waiting.values():
            assert seq.status is SequenceStatus.WAITING, f"{seq} in waiting queue"
            assert not seq.block_table, f"waiting {seq} holds blocks"
            assert seq.state_slot is None, f"waiting {seq} holds state slot {seq.state_slot}"
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        self.block_manager.check_invariants(seqs=self.running)

    def check_idle(self) -> bool:
        """True when nothing is queued and every block is free; AssertionError otherwise."""
        assert not self.running, f"still running: {self.running[:5]}"
        assert not self._waiting, f"still waiting: {list(self._waiting.values())[:5]}"
        self.block_manager.check_invariants(expect_idle=True)
        return True
