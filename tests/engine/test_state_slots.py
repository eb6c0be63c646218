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
