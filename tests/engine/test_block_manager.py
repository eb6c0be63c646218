"""BlockManager: allocation round trips, prefix caching (hits, token check, eviction)."""

from __future__ import annotations

import pytest

from llmserve.engine import block_manager as bm_module
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.sequence import Sequence, SequenceStatus


def make_seq(tokens: list[int], **kw) -> Sequence:
    return Sequence("req", tokens, **kw)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What a finished prefill looks like: blocks for every token, KV computed, cached."""
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_sequence_views():
    seq = make_seq([1, 2, 3, 4, 5])
    assert seq.status is SequenceStatus.WAITING
    seq.append_token(9)
    assert seq.prompt_token_ids == [1, 2, 3, 4, 5]
    assert seq.output_token_ids == [9]
    assert (seq.num_tokens, seq.num_output_tokens, seq.num_prompt_tokens) == (6, 1, 5)
    assert seq.num_blocks(4) == 2
    assert seq.block_tokens(0, 4) == [1, 2, 3, 4]
    assert seq.block_tokens(1, 4) == [5, 9]
    assert make_seq([1]).seq_id > seq.seq_id
    with pytest.raises(ValueError):
        make_seq([])


def test_allocate_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq, 10)
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants(seqs=[seq])

    # Growing within the last block needs nothing; crossing a boundary needs one block.
    seq.num_computed_tokens = 10
    assert bm.blocks_needed(seq, 2) == 0
    assert bm.blocks_needed(seq, 3) == 1
    assert bm.allocate(seq, 3) and len(seq.block_table) == 4

    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants(expect_idle=True)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.can_allocate(seq, 12)
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(seq, 8) and bm.num_free_blocks == 0
    bm.free(seq)
    bm.check_invariants(expect_idle=True)


def test_prefix_hit_across_sequences_only_after_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(100, 108))  # two full blocks
    a = make_seq(shared + [1, 2])
    assert bm.allocate(a, a.num_tokens)
    # Allocated but KV not computed yet: nothing may be registered.
    bm.cache_computed_blocks(a)
    b = make_seq(shared + [7, 7, 7])
    assert bm.match_prefix(b) == 0 and b.block_table == []
    assert bm.num_cached_blocks == 0

    # Partially computed: only the first block is full *and* computed.
    a.num_computed_tokens = 6
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = a.num_tokens
    bm.cache_computed_blocks(a)
    assert bm.num_cached_blocks == 2  # the partial tail block is never cached

    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    bm.check_invariants(seqs=[a, b])

    # The hit blocks outlive their first owner.
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1]
    bm.check_invariants(seqs=[b])
    bm.free(b)
    bm.check_invariants(expect_idle=True)
    assert bm.num_cached_blocks == 2  # free but still cached (evictable)


def test_hit_revives_a_free_cached_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)))
    compute_all(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4

    b = make_seq(list(range(9)) + [50])
    assert bm.match_prefix(b) == 8
    assert b.block_table == a_blocks[:2]
    assert bm.num_free_blocks == 2  # revived blocks left the free pool
    bm.check_invariants(seqs=[b])


def test_forced_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra=b"": 42)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute_all(bm, a)
    # Both full blocks hash to 42: the first registers, the second stays private.
    assert bm.num_cached_blocks == 1
    bm.check_invariants(seqs=[a])

    other = make_seq([9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert bm.match_prefix(other) == 0  # same hash, different tokens: no false hit
    assert other.block_table == []

    same = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Block 0 really matches; block 1 collides with block 0's entry but its tokens differ.
    assert bm.match_prefix(same) == 4
    assert same.block_table == a.block_table[:1]
    bm.check_invariants(seqs=[a, same])


def test_peek_prefix_counts_what_match_prefix_takes_and_takes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)))
    compute_all(bm, a)
    bm.free(a)
    for tokens, expected in ((list(range(9)) + [50], 8), (list(range(8)), 4), (list(range(5)) + [99, 1, 2, 3], 4),
                             ([7] + list(range(9)), 0), (list(range(4)), 0)):
        assert bm.peek_prefix(tokens) == expected, tokens
        assert bm.num_free_blocks == 4  # nothing taken, nothing revived
        seq = make_seq(tokens)
        assert bm.match_prefix(seq) == expected
        bm.free(seq)
    assert BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False).peek_prefix(list(range(9))) == 0
    bm.check_invariants(expect_idle=True)


def test_never_cache_all_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)))  # exactly two full blocks
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2

    same = make_seq(list(range(8)))
    cached = bm.match_prefix(same)
    assert cached == 4 < same.num_tokens  # the last hit was dropped
    assert len(same.block_table) == 1

    longer = make_seq(list(range(9)))
    assert bm.match_prefix(longer) == 8  # one token left to compute: all blocks usable

    tiny = make_seq(list(range(4)))
    assert bm.match_prefix(tiny) == 0
    bm.check_invariants(seqs=[a, same, longer])


def test_eviction_order_lru_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    compute_all(bm, a)
    head, mid, tail = a.block_table
    assert bm.num_cached_blocks == 2
    bm.free(a)
    # The never-used block goes first, then a's blocks tail-first (freed in reverse order).
    b = make_seq([8, 8, 8, 8])
    assert bm.allocate(b, 4)
    unused = ({0, 1, 2, 3} - {head, mid, tail}).pop()
    assert b.block_table == [unused, tail]
    assert bm.num_cached_blocks == 2  # tail was uncached (partial): nothing evicted yet
    c = make_seq([7, 7])
    assert bm.allocate(c, 2)
    assert c.block_table == [mid]  # handed out for new content: mid's hash is dropped
    assert bm.num_cached_blocks == 1
    bm.check_invariants(seqs=[b, c])

    probe = make_seq([1, 2, 3, 4, 5])
    assert bm.match_prefix(probe) == 2  # head survived, mid was evicted
    assert probe.block_table == [head]
    bm.check_invariants(seqs=[b, c, probe])


def test_recently_freed_prefix_survives_longer():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 1, 0])
    new = make_seq([2, 2, 0])
    compute_all(bm, old)
    compute_all(bm, new)
    old_blocks = list(old.block_table)
    bm.free(old)
    bm.free(new)
    filler = make_seq([5, 5, 5, 5])
    assert bm.allocate(filler, 4)
    # The filler took old's two blocks (least recently freed), so old's prefix is gone.
    assert sorted(filler.block_table) == sorted(old_blocks)
    assert bm.match_prefix(make_seq([1, 1, 0])) == 0
    assert bm.match_prefix(make_seq([2, 2, 0])) == 2


def test_duplicate_concurrent_prefix_registers_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    assert bm.allocate(a, 5) and bm.allocate(b, 5)  # both prefill before either is cached
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_computed_blocks(s)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[a.block_table[0]].hash != -1 and bm.blocks[b.block_table[0]].hash == -1
    assert a.block_hashes == b.block_hashes
    bm.check_invariants(seqs=[a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants(expect_idle=True)


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    compute_all(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq(list(range(9)))) == 0


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(list(range(5)))
    compute_all(bm, seq)
    bm.check_invariants(seqs=[seq])
    with pytest.raises(AssertionError, match="expected every block free"):
        bm.check_invariants(expect_idle=True)
    with pytest.raises(AssertionError, match="block-table refs"):
        bm.check_invariants(seqs=[seq, seq])
    bm.blocks[seq.block_table[0]].ref_count = 0
    with pytest.raises(AssertionError, match="in_free_pool"):
        bm.check_invariants()
    bm.blocks[seq.block_table[0]].ref_count = 1
    bm.blocks[seq.block_table[0]].hash = 1234
    with pytest.raises(AssertionError, match="hash"):
        bm.check_invariants()


def test_an_image_in_a_block_keys_it_and_every_block_after_it() -> None:
    """Two prompts of the same tokens whose image differs share the blocks before the image and
    none from the block holding its first token on; the same image finds them all."""
    from llmserve.media.inputs import MediaInput

    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(100, 118))  # five blocks: 4 full ones can be matched (the last token stays)

    def run(digest: str) -> Sequence:
        seq = Sequence("r", tokens, media=(MediaInput(digest, 6, 11),))  # positions 6-10: blocks 1 and 2
        bm.match_prefix(seq)
        return seq

    first = run("cat")
    assert first.block_table == []
    bm.allocate(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    bm.cache_computed_blocks(first)
    assert bm.peek_prefix(tokens, first.media) == 16
    other = run("dog")
    assert other.block_table == first.block_table[:1]  # the text before the image only
    assert bm.peek_prefix(tokens) == 4  # the same tokens without the image: the first block only
    again = run("cat")
    assert again.block_table == first.block_table[:4]
