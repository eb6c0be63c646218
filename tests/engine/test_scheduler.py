"""Scheduler: chunked prefill, continuous batching, priorities, preemption, aborts, simulation."""

from __future__ import annotations

import random

import pytest

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import ScheduledSeq, Scheduler
from llmserve.engine.sequence import Sequence, SequenceStatus


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, prefix=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_num_seqs, budget, chunked)


def make_seq(n_tokens: int, *, base: int = 0, priority: int = 5, arrival: float = 0.0) -> Sequence:
    return Sequence(f"r{base}", [base + i for i in range(n_tokens)], priority=priority, arrival=arrival)


def step(sched: Scheduler, targets: dict[int, int] | None = None, token: int = 7) -> list[ScheduledSeq]:
    """One engine iteration with a fake model that always samples ``token``."""
    batch = sched.schedule()
    sched.check_invariants()
    sched.on_step_done(batch)
    for item in batch:
        if item.sample:
            item.seq.append_token(token)
            if targets is not None and item.seq.num_output_tokens >= targets[item.seq.seq_id]:
                sched.finish(item.seq)
    return batch


def shape(batch: list[ScheduledSeq]) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_tokens, item.sample) for item in batch]


def test_chunked_prefill_splits_long_prompt():
    sched = make_sched(budget=32)
    seq = make_seq(100)
    sched.add(seq)
    sid = seq.seq_id
    assert sched.waiting_prompt_tokens == 100
    assert shape(step(sched)) == [(sid, 32, False)]
    assert seq.num_computed_tokens == 32 and seq.num_output_tokens == 0
    assert shape(step(sched)) == [(sid, 32, False)]
    assert shape(step(sched)) == [(sid, 32, False)]
    assert shape(step(sched)) == [(sid, 4, True)]  # last chunk reaches the end: sample
    assert seq.num_output_tokens == 1
    assert shape(step(sched)) == [(sid, 1, True)]  # now a plain decode
    assert seq.num_computed_tokens == 101 and len(seq.block_table) == 26


def test_chunk_shares_budget_with_decodes():
    sched = make_sched(budget=16)
    a = make_seq(4)
    sched.add(a)
    step(sched)
    b = make_seq(40, base=100)
    sched.add(b)
    assert shape(step(sched)) == [(a.seq_id, 1, True), (b.seq_id, 15, False)]
    assert shape(step(sched)) == [(a.seq_id, 1, True), (b.seq_id, 15, False)]
    assert shape(step(sched)) == [(a.seq_id, 1, True), (b.seq_id, 10, True)]


def test_without_chunking_prompt_waits_for_a_step_with_room():
    sched = make_sched(budget=10, chunked=False)
    a = make_seq(4)
    sched.add(a)
    step(sched)
    b = make_seq(10, base=100)
    sched.add(b)
    # a's decode takes 1 of 10 tokens; b's whole prompt (10) no longer fits, and no chunking.
    assert shape(step(sched)) == [(a.seq_id, 1, True)]
    sched.finish(a)
    assert shape(step(sched)) == [(b.seq_id, 10, True)]
    too_long = make_seq(11, base=200)
    sched.add(too_long)
    step(sched)
    assert sched.unschedulable == [too_long] and too_long.status is SequenceStatus.FINISHED


def test_continuous_batching_new_seq_joins_decodes():
    sched = make_sched()
    a, b = make_seq(5), make_seq(6, base=100)
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == [(a.seq_id, 5, True), (b.seq_id, 6, True)]
    assert shape(step(sched)) == [(a.seq_id, 1, True), (b.seq_id, 1, True)]
    c = make_seq(7, base=200)
    sched.add(c)
    assert sched.num_waiting == 1 and sched.num_running == 2
    assert shape(step(sched)) == [(a.seq_id, 1, True), (b.seq_id, 1, True), (c.seq_id, 7, True)]
    assert sched.num_waiting == 0 and sched.num_running == 3
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (3, 3, 1)


def test_max_num_seqs_limits_the_batch():
    sched = make_sched(max_num_seqs=2)
    seqs = [make_seq(3, base=10 * i, arrival=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [i.seq for i in step(sched)] == seqs[:2]
    assert sched.num_waiting == 1
    sched.finish(seqs[0])
    assert [i.seq for i in step(sched)] == [seqs[1], seqs[2]]


def test_priority_then_arrival_orders_admission():
    sched = make_sched(max_num_seqs=1)
    spec = [(5, 0.0), (1, 1.0), (3, 2.0), (1, 3.0), (5, -1.0)]
    seqs = [make_seq(3, base=10 * k, priority=p, arrival=t) for k, (p, t) in enumerate(spec)]
    for s in seqs:
        sched.add(s)
    targets = {s.seq_id: 1 for s in seqs}
    order = []
    while sched.has_work:
        order += [i.seq for i in step(sched, targets)]
    assert order == [seqs[1], seqs[3], seqs[2], seqs[4], seqs[0]]
    assert sched.check_idle()


def _tiny(prefix=True) -> Scheduler:
    # 4 blocks of 4 tokens: two 6-token prompts fill half each; growth forces preemption.
    return make_sched(num_blocks=4, block_size=4, prefix=prefix)


@pytest.mark.parametrize("b_priority, b_arrival", [(5, 0.5), (1, 2.0)])
def test_preemption_picks_worst_priority_then_latest_arrival(b_priority, b_arrival):
    sched = _tiny()
    a = make_seq(6, base=0, priority=1, arrival=1.0)
    b = make_seq(6, base=100, priority=b_priority, arrival=b_arrival)  # worse either way
    sched.add(a)
    sched.add(b)
    targets = {a.seq_id: 4, b.seq_id: 4}
    for _ in range(3):
        assert {i.seq for i in step(sched, targets)} == {a, b}
    assert sched.block_manager.num_free_blocks == 0
    # a needs a third block for its 9th token: b is the victim.
    assert [i.seq for i in step(sched, targets)] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_output_tokens == 3  # generated tokens survive; they are recomputed later
    assert sched.num_preemptions_total == 1
    while sched.has_work:
        step(sched, targets)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert b.status is SequenceStatus.FINISHED and sched.check_idle()


def test_preemption_can_pick_the_growing_seq_itself():
    sched = _tiny()
    worst = make_seq(6, base=0, priority=9)
    sched.add(worst)
    step(sched)  # admitted alone, so it is first in the running order
    best = make_seq(6, base=100, priority=1)
    sched.add(best)
    step(sched)
    step(sched)
    assert sched.running == [worst, best]
    # worst needs a new block and is itself the worst-ranked: it yields, best still runs.
    assert shape(step(sched)) == [(best.seq_id, 1, True)]
    assert worst.status is SequenceStatus.WAITING and worst.num_preemptions == 1


def test_preempting_an_already_scheduled_victim_drops_it_from_the_batch():
    sched = _tiny()
    worst = make_seq(5, base=0, priority=9)
    sched.add(worst)
    step(sched)
    best = make_seq(8, base=100, priority=1)
    sched.add(best)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    # worst's decode fits its blocks and is scheduled first; best then needs a block and
    # evicts worst, whose slot and budget must leave the batch.
    batch = step(sched)
    assert shape(batch) == [(best.seq_id, 1, True)]
    assert worst.status is SequenceStatus.WAITING and worst.num_output_tokens == 2
    step(sched)  # no admissions in a step that preempted; next step tries again
    sched.finish(best)
    assert [i.seq for i in step(sched)] == [worst]  # recomputes prompt + 2 outputs
    assert worst.num_computed_tokens == 7 and worst.num_output_tokens == 3


def test_abort_waiting_and_running_frees_everything():
    sched = make_sched(num_blocks=8, max_num_seqs=2)
    seqs = [make_seq(6, base=100 * i, arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2
    assert sched.block_manager.num_free_blocks == 4
    sched.abort(seqs[2])  # waiting
    sched.abort(seqs[0])  # running
    assert sched.num_waiting == 1 and sched.running == [seqs[1]]
    # Aborted between schedule() and on_step_done(): its item is ignored.
    batch = sched.schedule()
    assert seqs[3] in [i.seq for i in batch]
    sched.abort(seqs[3])
    sched.on_step_done(batch)
    assert seqs[3].num_computed_tokens == 0
    sched.abort(seqs[1])
    sched.abort(seqs[1])  # idempotent
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert not sched.has_work and sched.check_idle()


def test_prefix_hits_and_cached_tokens_recorded_on_first_admission_only():
    sched = make_sched(num_blocks=64)
    a = make_seq(10)
    sched.add(a)
    step(sched)
    b = Sequence("rb", list(range(8)) + [99, 98, 97])
    sched.add(b)
    batch = step(sched)
    assert shape(batch)[-1] == (b.seq_id, 3, True)  # 8 cached tokens skipped
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    bm = sched.block_manager
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (21, 8)

    sched._preempt(b)  # as the growth path would; re-admission now hits b's own blocks too
    batch = step(sched)
    assert shape(batch)[-1] == (b.seq_id, 4, True)  # 12 tokens, 8 cached, 4 recomputed
    assert b.num_cached_tokens == 8  # usage keeps the first admission's count
    sched.finish(a)
    sched.finish(b)
    assert sched.check_idle()


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    """Gemma 3's image tokens see the whole image: a chunk stops before such a run, or, starting
    inside one (a prefix-cache hit within the image), goes past its end over the budget."""
    from llmserve.media.inputs import MediaInput, chunk_end

    image = MediaInput("pic", 6, 26, None, ((8, 24),))
    assert [chunk_end([image], s, e) for s, e in [(0, 8), (0, 12), (0, 24), (8, 20), (12, 13), (24, 30)]] == \
        [8, 8, 24, 24, 24, 30]
    assert chunk_end([MediaInput("plain", 6, 26)], 0, 12) == 12  # an image of causal tokens is cut anywhere
    sched = make_sched(budget=12)
    a = Sequence("ra", list(range(40)), media=(image,))
    sched.add(a)
    assert [item.num_tokens for item in (step(sched)[0], step(sched)[0], step(sched)[0], step(sched)[0])] == \
        [8, 16, 12, 4]
    # A prompt sharing the first 18 tokens and the image: its cached blocks (4 tokens each) end
    # inside the run, and the chunk that continues them, over a budget of 6, ends at the run's end.
    sched.finish(a)
    sched.max_num_batched_tokens = 6
    b = Sequence("rb", list(range(18)) + [99] * 22, media=(image,))
    sched.add(b)
    first = step(sched)[-1]
    assert first.seq is b and b.num_cached_tokens == 16 and first.num_tokens == 8
    assert shape(step(sched))[-1] == (b.seq_id, 6, False)


def test_seq_larger_than_pool_is_unschedulable_not_livelocked():
    sched = make_sched(num_blocks=4, block_size=4, budget=8)
    ok = make_seq(3, base=100, priority=9)
    sched.add(ok)
    step(sched, {ok.seq_id: 100})
    huge = make_seq(17)  # 5 blocks > pool, admitted chunk by chunk first
    sched.add(huge)
    seen = []
    for _ in range(10):
        step(sched, {huge.seq_id: 100, ok.seq_id: 100})
        seen += sched.unschedulable
        if huge.is_finished:
            break
    assert seen == [huge] and huge.block_table == []
    # ok was preempted to make room for huge's second chunk, then re-admitted once huge,
    # alone in the pool and still short, was given up on.
    assert ok.num_preemptions == 1 and ok.status is SequenceStatus.RUNNING
    sched.finish(ok)
    assert sched.check_idle()

    grower = make_seq(14)  # fits at first, outgrows the pool while decoding alone
    sched.add(grower)
    for _ in range(10):
        step(sched, {grower.seq_id: 100})
        if sched.unschedulable:
            break
    assert sched.unschedulable == [grower] and grower.num_tokens == 17
    assert sched.check_idle()


@pytest.mark.parametrize("seed, chunked", [(0, True), (1, True), (2, False)])
def test_randomized_simulation(seed, chunked):
    rng = random.Random(seed)
    bs, num_blocks, max_seqs = 4, 16, 6
    budget = 24 if chunked else 48  # chunked: prompts (up to 32 tokens) must split
    sched = make_sched(num_blocks=num_blocks, block_size=bs, max_num_seqs=max_seqs,
                       budget=budget, chunked=chunked)
    bm = sched.block_manager
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    arrivals: list[tuple[int, Sequence]] = []
    targets: dict[int, int] = {}
    t = 0
    while len(arrivals) < 200:
        t += rng.randint(0, 2)
        prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
        prio = rng.randint(1, 5)
        for j in range(min(rng.choice([1, 1, 1, 2]), 200 - len(arrivals))):  # n=2 shares a prompt
            seq = Sequence(f"q{len(arrivals)}", prompt, index=j, priority=prio, arrival=float(t))
            arrivals.append((t, seq))
            targets[seq.seq_id] = rng.randint(1, 15)
    everyone = [s for _, s in arrivals]
    aborted: set[int] = set()
    kv = [[None] * bs for _ in range(num_blocks)]  # fake KV: which token each slot holds

    for now in range(100_000):
        while arrivals and arrivals[0][0] <= now:
            sched.add(arrivals.pop(0)[1])
        live = [s for s in everyone if s.status is not SequenceStatus.FINISHED and s.seq_id in targets
                and (s.status is SequenceStatus.RUNNING or sched._waiting.get(s.seq_id) is s)]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            sched.abort(victim)
            aborted.add(victim.seq_id)
        batch = sched.schedule()
        assert not sched.unschedulable
        sched.check_invariants()
        assert len(batch) <= max_seqs and sum(i.num_tokens for i in batch) <= budget
        assert len({i.seq.seq_id for i in batch}) == len(batch)
        for item in batch:  # the fake backend: verify cached KV, write the new positions
            seq, start = item.seq, item.seq.num_computed_tokens
            assert seq.status is SequenceStatus.RUNNING and item.num_tokens > 0
            assert start + item.num_tokens <= seq.num_tokens
            assert item.sample == (start + item.num_tokens == seq.num_tokens)
            for p in range(start):
                assert kv[seq.block_table[p // bs]][p % bs] == seq.token_ids[p], "stale KV reused"
            for p in range(start, start + item.num_tokens):
                block = seq.block_table[p // bs]
                assert bm.blocks[block].ref_count == 1, "wrote into a shared block"
                kv[block][p % bs] = seq.token_ids[p]
        sched.on_step_done(batch)
        for item in batch:
            if item.sample:
                item.seq.append_token(rng.randrange(50))
                if item.seq.num_output_tokens >= targets[item.seq.seq_id]:
                    sched.finish(item.seq)
        if not arrivals and not sched.has_work:
            break
    else:
        pytest.fail("simulation did not drain")

    assert sched.check_idle()
    assert all(s.status is SequenceStatus.FINISHED for s in everyone)
    done = [s for s in everyone if s.seq_id not in aborted]
    assert all(s.num_output_tokens == targets[s.seq_id] for s in done)
    assert 0 < len(aborted) < len(everyone)
    assert sched.num_preemptions_total > 0  # the pool really was tight
    assert bm.prefix_hit_tokens > 0
