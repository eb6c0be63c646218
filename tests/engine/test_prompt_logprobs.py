"""Prompt logprobs gathered across prefill chunks: each entry lands at its prompt position, with
the backend's rank, and a chunk computed again after a preemption replaces its entries."""

from __future__ import annotations

from llmserve.engine.backend import StepResult
from llmserve.engine.postprocess import RequestState, add_prompt_logprobs
from llmserve.engine.scheduler import ScheduledSeq
from llmserve.engine.sequence import Sequence
from llmserve.outputs import Timings
from llmserve.request import PreparedRequest
from llmserve.sampling import SamplingParams

PROMPT = [10, 11, 12, 13, 14, 15]


def chunk(state: RequestState, seq: Sequence, start: int, size: int, base: float) -> None:
    """Feed prompt tokens ``start .. start + size - 1``, as the engine does after the step."""
    seq.num_computed_tokens = start + size
    targets = PROMPT[start + 1: min(start + size + 1, len(PROMPT))]
    result = StepResult(seq.seq_id, prompt_logprobs=[(base - k, [(t, base - k)]) for k, t in enumerate(targets)],
                        prompt_ranks=[k + 1 for k in range(len(targets))])
    add_prompt_logprobs(state, ScheduledSeq(seq, size, False), result)


def new_state() -> tuple[RequestState, Sequence]:
    sp = SamplingParams(prompt_logprobs=1)
    seq = Sequence("r", PROMPT, sp)
    state = RequestState(PreparedRequest("r", None, tuple(PROMPT), sp), PROMPT, [seq],
                         lambda _: None, Timings(), prompt_logprobs=[None])
    return state, seq


def test_chunks_fill_positions_in_order_with_ranks():
    state, seq = new_state()
    chunk(state, seq, 0, 4, -1.0)
    assert not state.prompt_logprobs_done
    chunk(state, seq, 4, 2, -5.0)
    assert state.prompt_logprobs_done
    got = state.prompt_logprobs
    assert got[0] is None and [e.token_id for e in got[1:]] == PROMPT[1:]
    assert [e.logprob for e in got[1:]] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert [e.rank for e in got[1:]] == [1, 2, 3, 4, 1]


def test_a_chunk_computed_again_after_preemption_replaces_its_entries():
    state, seq = new_state()
    chunk(state, seq, 0, 3, -1.0)
    seq.num_computed_tokens = 0  # preempted (recompute): the prompt starts over
    chunk(state, seq, 0, 3, -7.0)
    chunk(state, seq, 3, 3, -9.0)
    got = state.prompt_logprobs
    assert len(got) == len(PROMPT) and state.prompt_logprobs_done
    assert [e.logprob for e in got[1:]] == [-7.0, -8.0, -9.0, -9.0, -10.0]  # the second pass, then chunk 2
    assert [e.token_id for e in got[1:]] == PROMPT[1:]
