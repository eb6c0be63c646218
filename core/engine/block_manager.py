"""KV block bookkeeping with hash-chained prefix caching (no tensors: ids and ref counts only).

The backend owns the KV tensors; this module only decides which physical block holds what.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence as Seq
from dataclasses import dataclass

from llmserve.engine.sequence import Sequence
from llmserve.engine.state_slots import StateSlots, StateSnapshots
from llmserve.media.inputs import MediaInput, block_key

ROOT_HASH = 0  # parent hash of block 0; real hashes are unsigned 64-bit so -1 can mean "none"


def hash_block(parent_hash: int, token_ids: Seq[int], extra: bytes = b"") -> int:
    """Deterministic 64-bit hash of (parent block hash, tokens of this block, ``extra``: the
    digests of the images in its positions, ``llmserve.media.inputs.block_key``).

    Chaining the parent makes a block's hash identify the whole prefix up to its end, so a
    hit on block i implies the KV of every earlier position is identical too; an image's digest
    in its first block changes the hash of every block after it.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1                   # -1: not registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # content when hashed, for the token check on a hit


class BlockManager:
    """Hands out fixed-size KV blocks and shares full, computed blocks between sequences.

    Free blocks (ref_count 0) live in an LRU-ordered pool; cached ones stay registered in
    the hash table while free, so a later request can revive them. A cached block is only
    evicted when the pool hands it out for new content.

    With ``state_slots`` (a hybrid model: layers that keep a fixed-size recurrent state per
    sequence) a sequence also takes a state slot with its first blocks and gives it back with
    them: admission waits for a slot as it waits for blocks, and every path that frees a
    sequence's blocks (finish, abort, preemption) frees its slot. Cached blocks alone do not resume
    such a sequence: with ``state_snapshots`` a prompt's state is saved at its last block boundary,
    and an answer's at each block boundary it crosses, the latest one kept a sequence (``plan_snapshot``,
    ``commit_snapshots``: a conversation's next turn resumes after the answer), and a prefix hit
    reaches only as far as a saved state.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_slots: int = 0, state_snapshots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict as an ordered set: O(1) pop of the least-recently freed block and O(1)
        # removal of a free cached block revived by a prefix hit (a deque would be O(n)).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.state_slots = StateSlots(state_slots) if state_slots else None
        self.snapshots = StateSnapshots(state_snapshots) if state_slots and state_snapshots else None
        # (sequence, boundary, snapshot id, inside its answer) of this step
        self._saving: list[tuple[Sequence, int, int, bool]] = []

    # -- capacity ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (evictable cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks for the block table to cover ``num_computed_tokens + num_new_tokens``."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more (and give ``seq`` a state slot
        when the model keeps one and it has none); False (no change) if short of either."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        if self.state_slots is not None and seq.state_slot is None:
            seq.state_slot = self.state_slots.acquire()
            if seq.state_slot is None:
                return False
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its KV is gone as far as the sequence is concerned."""
        # Reverse order: the tail of a prefix is freed first, so it is evicted before the
        # head, which is the part other requests are most likely to share.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        if seq.state_slot is not None and self.state_slots is not None:
            self.state_slots.release(seq.state_slot)
        seq.state_slot = seq.state_restore = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the ones ``seq``'s tokens need: those a step allocated for
        proposed tokens that were not accepted (never hashed: nothing in them was computed)."""
        keep = seq.num_blocks(self.block_size)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _evict(self, block: Block) -> None:
        if block.hash != -1:
            del self._hash_to_block[block.hash]
            block.hash = -1
            block.token_ids = ()

    # -- prefix caching ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Take cached blocks for the leading full blocks of a block-less sequence.

        Returns the number of cached tokens (a multiple of block_size). At least one token
        is always left uncached: its logits are needed to sample the next token. Does not
        touch ``seq.num_computed_tokens`` or the hit counters (see ``record_prefix_query``).
        """
        assert not seq.block_table, f"match_prefix on {seq} which already has blocks"
        hits = self._resumable(list(self._cached_blocks(seq.token_ids, seq.media)))
        if hits and self.snapshots is not None:
            seq.state_restore = self.snapshots.take(hits[-1][1])
        for block_id, h in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        return len(seq.block_table) * self.block_size

    def peek_prefix(self, token_ids: Seq[int], media: Seq[MediaInput] = ()) -> int:
        """How many leading tokens of ``token_ids`` (with images ``media``) a request admitted now
        would find cached (what ``match_prefix`` would take), taking nothing. It only reads, so the
        server may ask from its own thread; a block evicted meanwhile makes the answer an estimate."""
        return len(self._resumable(list(self._cached_blocks(token_ids, media)))) * self.block_size

    def _resumable(self, hits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The leading cached blocks a sequence can resume after: all of them, or for a model with
        a recurrent state those up to the last one whose chain has a saved state (none without)."""
        if self.state_slots is None:
            return hits
        n = len(hits)
        while n and (self.snapshots is None or not self.snapshots.has(hits[n - 1][1])):
            n -= 1
        return hits[:n]

    def plan_snapshot(self, seq: Sequence, start: int, num_tokens: int) -> tuple[int, int] | None:
        """Where (in tokens) and into which snapshot the backend saves ``seq``'s state in a step
        feeding positions ``start .. start + num_tokens - 1``: at its prompt's last block boundary
        (the furthest a later request's prefix hit can reach) when the step crosses it, or at a
        block boundary inside its answer (a next turn that repeats the answer resumes there); None
        when it crosses neither or no snapshot id is free. ``commit_snapshots`` settles it after
        the step."""
        if self.snapshots is None or not self.enable_prefix_caching:
            return None
        bs = self.block_size
        boundary = (seq.num_prompt_tokens - 1) // bs * bs
        answer = (start + num_tokens) // bs * bs  # the last boundary this step reaches
        if boundary and start < boundary <= start + num_tokens:
            at = boundary
        elif answer > boundary and start < answer:
            at = answer
        else:
            return None
        sid = self.snapshots.reserve()
        if sid is None:
            return None
        self._saving.append((seq, at, sid, at > boundary))
        return at, sid

    def commit_snapshots(self) -> None:
        """After the step (and ``cache_computed_blocks``): each saved state goes under the hash of
        the chain ending at its boundary (one inside an answer replaces the sequence's previous
        one); one whose sequence left meanwhile is dropped."""
        if self.snapshots is None:
            self._saving.clear()
            return
        for seq, at, sid, answer in self._saving:
            k = at // self.block_size
            if len(seq.block_hashes) < k:
                self.snapshots.cancel(sid)
                continue
            chain = seq.block_hashes[k - 1]
            self.snapshots.commit(chain, sid)
            if answer:
                if seq.answer_saved is not None and seq.answer_saved != chain:
                    self.snapshots.drop(seq.answer_saved)
                seq.answer_saved = chain
        self._saving.clear()

    def _cached_blocks(self, token_ids: Seq[int], media: Seq[MediaInput] = ()) -> Iterator[tuple[int, int]]:
        """(block id, hash) of each cached block holding the leading full blocks of ``token_ids``."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # (len - 1) // bs full blocks at most: when the tokens end exactly on a block boundary
        # this drops the last full block, so the cache never covers every token.
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, tokens, block_key(media, i, bs) if media else b"")
            block_id = self._hash_to_block.get(h)
            # Token check: a hash match alone could be a collision, which would silently
            # reuse someone else's KV.
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                return
            yield block_id, h
            parent = h

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission for the hit-rate metric (the scheduler calls it on success)."""
        self.prefix_queried_tokens += num_queried_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block of ``seq`` whose KV is now computed and not yet hashed.

        Called after a step: registering earlier would let another sequence hit on a block
        whose KV has not been written yet.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i else ROOT_HASH
            tokens = tuple(seq.block_tokens(i, bs))
            h = hash_block(parent, tokens, block_key(seq.media, i, bs) if seq.media else b"")
            seq.block_hashes.append(h)  # the chain continues even if we cannot register
            if h in self._hash_to_block:
                # Another sequence computed the same prefix concurrently (or a collision):
                # keep the existing entry; this block stays private and uncached.
                continue
            block = self.blocks[seq.block_table[i]]
            block.hash = h
            block.token_ids = tokens
            self._hash_to_block[h] = block.block_id

    # -- checks ------------------------------------------------------------------------------
    def check_invariants(self, expect_idle: bool = False, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError if ref counts, free pool and hash table disagree.

        With ``seqs`` (every sequence holding blocks), ref counts must equal the number of
        block-table references. With ``expect_idle``, every block must be free.
        """
        free_ids = set(self._free)
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has negative ref_count {b.ref_count}"
            in_free = b.block_id in free_ids
            assert in_free == (b.ref_count == 0), (
                f"block {b.block_id}: ref_count={b.ref_count} but in_free_pool={in_free}"
            )
            if b.hash != -1:
                assert self._hash_to_block.get(b.hash) == b.block_id, (
                    f"block {b.block_id} has hash {b.hash} not mapped to it in the hash table"
                )
                assert len(b.token_ids) == self.block_size, (
                    f"cached block {b.block_id} holds {len(b.token_ids)} tokens, not a full block"
                )
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h, (
                f"hash table maps {h} to block {block_id} whose hash is {self.blocks[block_id].hash}"
            )
        if seqs is not None:
            refs = [0] * self.num_blocks
            for seq in seqs:
                assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} repeats a block"
                assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, (
                    f"{seq}: computed tokens exceed its blocks"
                )
                for block_id in seq.block_table:
                    refs[block_id] += 1
            for b in self.blocks:
                assert refs[b.block_id] == b.ref_count, (
                    f"block {b.block_id}: ref_count={b.ref_count} but {refs[b.block_id]} block-table refs"
                )
            if self.state_slots is not None:
                self.state_slots.check([seq.state_slot for seq in seqs], expect_idle)
        elif expect_idle and self.state_slots is not None:
            self.state_slots.check([], expect_idle=True)
        if self.snapshots is not None:
            self.snapshots.check(expect_idle)
        if expect_idle:
            busy = [b.block_id for b in self.blocks if b.ref_count]
            assert not busy, f"expected every block free, still referenced: {busy[:20]}"
            assert len(self._free) == self.num_blocks, (
                f"free pool has {len(self._free)} of {self.num_blocks} blocks"
            )
