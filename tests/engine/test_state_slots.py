"""State slots (a hybrid model's recurrent state per running sequence): handed out with a
sequence's first blocks, taken back wherever its blocks go (finish, abort, preemption, a
failed admission), and admission waits for one as it waits for blocks."""

from __future__ import annotations

import random

import pytest

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Sequence
from llmserve.engine.state_slots import StateSlots

from .test_scheduler import make_seq, step


def test_slots_go_out_lowest_first_and_come_back() -> None:
    slots = StateSlots(3)
    assert [slots.acquire(), slots.acquire()] == [0, 1]
    slots.release(0)
    assert slots.acquire() == 0 and slots.acquire() == 2 and slots.acquire() is None
    assert slots.num_used == 3 and slots.num_free == 0
    slots.release(1)
    with pytest.raises(ValueError):
        slots.release(1)  # not held
    with pytest.raises(ValueError):
        slots.release(7)
    slots.check([0, 2])
    with pytest.raises(AssertionError, match="held by no sequence"):
        slots.check([0])
    with pytest.raises(AssertionError, match="held twice"):
        slots.check([0, 0, 2])
    with pytest.raises(ValueError):
        StateSlots(0)


def test_the_block_manager_gives_a_slot_with_the_first_blocks() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False, state_slots=2)
    a, b, c = (Sequence(f"r{i}", [1, 2, 3, 4, 5]) for i in range(3))
    assert bm.allocate(a, 5) and a.state_slot == 0 and len(a.block_table) == 2
    assert bm.allocate(a, 1) and a.state_slot == 0  # growing keeps the slot
    assert bm.allocate(b, 5) and b.state_slot == 1
    free = bm.num_free_blocks
    assert not bm.allocate(c, 5), "no slot left: the allocation must fail"
    assert c.state_slot is None and not c.block_table and bm.num_free_blocks == free
    bm.free(a)
    assert a.state_slot is None
    assert bm.allocate(c, 5) and c.state_slot == 0
    bm.check_invariants(seqs=[b, c])
    bm.free(b)
    bm.free(c)
    bm.check_invariants(expect_idle=True, seqs=[])


def test_a_slot_held_by_nobody_is_caught() -> None:
    bm = BlockManager(8, 4, state_slots=2)
    a = Sequence("r", [1, 2, 3])
    bm.allocate(a, 3)
    a.state_slot = None  # lost track of it
    with pytest.raises(AssertionError, match="state slots"):
        bm.check_invariants(seqs=[a])


def test_admission_waits_for_a_slot_and_preemption_frees_it() -> None:
    # Room for 8 sequences by count and blocks, slots for 2: the third waits.
    sched = Scheduler(BlockManager(64, 4, False, state_slots=2), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(5, base=10 * i, arrival=float(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = step(sched)
    assert [item.seq for item in batch] == seqs[:2] and sched.num_waiting == 1
    assert {s.state_slot for s in seqs[:2]} == {0, 1} and seqs[2].state_slot is None
    sched.finish(seqs[0])
    step(sched)
    assert seqs[2].state_slot == 0 and sched.num_running == 2
    sched._preempt(seqs[2])
    assert seqs[2].state_slot is None and sched.block_manager.state_slots.num_free == 1
    sched.check_invariants()


def test_random_traffic_never_leaks_a_slot() -> None:
    """Sequences arrive, grow, finish and are aborted at random in a pool tight enough to preempt;
    the invariants (each running sequence one slot, none held twice or lost) hold at every step."""
    rng = random.Random(5)
    sched = Scheduler(BlockManager(12, 4, False, state_slots=3), max_num_seqs=6, max_num_batched_tokens=24)
    targets: dict[int, int] = {}
    live: list[Sequence] = []
    for i in range(300):
        if rng.random() < 0.3:
            seq = make_seq(rng.randint(1, 20), base=100 * i, arrival=float(i))
            targets[seq.seq_id] = rng.randint(1, 12)
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            sched.abort(live.pop(rng.randrange(len(live))))
        step(sched, targets)
        assert sched.block_manager.state_slots.num_used == sched.num_running <= 3
    while sched.has_work:
        step(sched, targets)
    assert sched.num_preemptions_total > 0
    sched.check_idle()


def test_saved_states_are_kept_least_recently_used_first() -> None:
    from llmserve.engine.state_slots import StateSnapshots

    saved = StateSnapshots(2)
    a, b = saved.reserve(), saved.reserve()
    assert {a, b} == {0, 1} and saved.reserve() is None  # both wait for their step
    saved.commit(111, a)
    saved.commit(222, b)
    assert saved.take(111) == a  # 111 is now the most recently used
    c = saved.reserve()
    assert c == b and not saved.has(222) and saved.has(111)  # 222 made room
    saved.commit(111, c)  # already saved under that chain: the id goes back
    assert saved.num_saved == 1 and saved.reserve() == c
    saved.cancel(c)
    saved.check(expect_idle=True)
    d = saved.reserve()
    with pytest.raises(AssertionError, match="pending"):
        saved.check(expect_idle=True)
    saved.cancel(d)


def _hybrid_bm(saved: int = 4) -> BlockManager:
    return BlockManager(32, 4, True, state_slots=4, state_snapshots=saved)


def _run_prompt(bm: BlockManager, seq: Sequence) -> int:
    """Admit ``seq``, feed its whole prompt in one step (saving where the manager plans) and settle;
    the tokens its prefix hit covered."""
    cached = bm.match_prefix(seq)
    seq.num_computed_tokens = cached
    n = seq.num_tokens - cached
    assert bm.allocate(seq, n)
    bm.plan_snapshot(seq, cached, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    bm.commit_snapshots()
    return cached


def test_a_prefix_hit_reaches_only_as_far_as_a_saved_state() -> None:
    bm = _hybrid_bm()
    first = Sequence("a", list(range(1, 15)))  # 14 tokens: blocks end at 4, 8 and 12; saved at 12
    assert bm.plan_snapshot(first, 0, 4) is None  # a step that does not reach the boundary saves nothing
    assert _run_prompt(bm, first) == 0
    assert bm.snapshots.num_saved == 1
    twin = Sequence("b", list(range(1, 15)))
    assert bm.peek_prefix(twin.token_ids) == 12
    assert bm.match_prefix(twin) == 12 and twin.state_restore is not None
    bm.free(twin)
    assert twin.state_restore is None
    # Shares only the first 9 tokens: the blocks ending at 4 and 8 are cached but no state was
    # saved there, so nothing is reused.
    branch = Sequence("c", list(range(1, 10)) + [99, 98, 97, 96, 95])
    assert bm.peek_prefix(branch.token_ids) == 0 and bm.match_prefix(branch) == 0
    assert branch.state_restore is None
    # A longer prompt extending the first resumes at 12 and saves its own boundary (20).
    longer = Sequence("d", list(range(1, 23)))
    assert _run_prompt(bm, longer) == 12
    assert bm.snapshots.num_saved == 2 and bm.peek_prefix(list(range(1, 24))) == 20
    bm.free(first)
    bm.free(longer)
    bm.check_invariants(expect_idle=True, seqs=[])


def test_an_answer_keeps_its_latest_saved_state() -> None:
    """Decoding past block boundaries saves the state at each, the latest one kept a sequence
    (each new one frees the one before): the next turn (the prompt, the answer and a new message)
    resumes after the answer, not at the prompt's boundary."""
    bm = _hybrid_bm()
    seq = Sequence("a", list(range(1, 7)))  # 6 tokens: the prompt's state saved at 4
    assert _run_prompt(bm, seq) == 0 and bm.snapshots.num_saved == 1
    saves = []
    for t in range(100, 110):  # ten answer tokens, each fed in the next step
        seq.append_token(t)
        start = seq.num_computed_tokens
        assert bm.allocate(seq, 1)
        saves.append(bm.plan_snapshot(seq, start, 1))
        seq.num_computed_tokens += 1
        bm.cache_computed_blocks(seq)
        bm.commit_snapshots()
        assert bm.snapshots.num_saved <= 2  # the prompt's, and the answer's latest
    assert [s[0] for s in saves if s is not None] == [8, 12, 16]  # positions 7, 11 and 15 reach them
    assert bm.snapshots.num_saved == 2 and seq.answer_saved == seq.block_hashes[3]
    bm.free(seq)
    turn2 = Sequence("b", seq.token_ids[:16] + [200, 201, 202])
    assert bm.match_prefix(turn2) == 16 and turn2.state_restore is not None
    bm.free(turn2)
    bm.check_invariants(expect_idle=True, seqs=[])


def test_a_save_whose_sequence_left_is_dropped() -> None:
    bm = _hybrid_bm(saved=1)
    seq = Sequence("a", list(range(1, 15)))
    assert bm.allocate(seq, 14)
    assert bm.plan_snapshot(seq, 0, 14) == (12, 0)
    bm.free(seq)  # aborted while the step ran
    bm.commit_snapshots()
    assert bm.snapshots.num_saved == 0
    bm.check_invariants(expect_idle=True, seqs=[])


def test_without_saved_states_a_hybrid_takes_no_prefix_hits() -> None:
    bm = BlockManager(32, 4, True, state_slots=2)  # prefix caching on, no snapshots
    seq = Sequence("a", list(range(1, 15)))
    assert bm.allocate(seq, 14)
    seq.num_computed_tokens = 14
    bm.cache_computed_blocks(seq)
    assert bm.plan_snapshot(seq, 0, 14) is None
    assert bm.peek_prefix(list(range(1, 15))) == 0
