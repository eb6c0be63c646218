"""After the backend's step: sampled tokens -> text, stop checks and output events.

Per sequence: append the token, detokenize incrementally, check EOS / stop token ids / stop
strings / max_tokens / context length. Per request: collect the deltas into one
``RequestOutput`` (best_of: only the final, ranked one), and gather prompt logprobs. Pure
bookkeeping on the engine's request records: no scheduler, no backend, no sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llmserve.engine.backend import StepResult
from llmserve.engine.budget import BudgetTracker
from llmserve.engine.scheduler import ScheduledSeq
from llmserve.engine.sequence import Sequence
from llmserve.outputs import FinishReason, RequestOutput, SequenceDelta, Timings, TokenLogprob, Usage
from llmserve.request import PreparedRequest
from llmserve.sampling import SamplingParams
from llmserve.text.detokenizer import IncrementalDetokenizer
from llmserve.text.stop import StopChecker

Sink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class SeqState:
    """Per-sequence postprocessing state (lives in ``Sequence.state``)."""

    detok: IncrementalDetokenizer
    stop: StopChecker
    max_tokens: int
    cumulative_logprob: float = 0.0
    delta: SequenceDelta | None = None
    text_parts: list[str] = field(default_factory=list)        # best_of only: whole output
    all_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    budget: BudgetTracker | None = None  # the request's thinking budget, when it has one

    @classmethod
    def new(cls, tokenizer: object, prompt_ids: list[int], sp: SamplingParams, max_tokens: int) -> "SeqState":
        return cls(detok=IncrementalDetokenizer(tokenizer, prompt_ids, sp.skip_special_tokens,
                                                sp.spaces_between_special_tokens),
                   stop=StopChecker(sp.stop, sp.include_stop_str_in_output), max_tokens=max_tokens)


@dataclass(slots=True)
class RequestState:
    """The engine's record of one request: its sequences, where its events go, its timings."""

    request: PreparedRequest
    prompt_ids: list[int]
    seqs: list[Sequence]
    sink: Sink
    timings: Timings
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_done: bool = False
    first_sent: bool = False
    buffered: bool = False      # best_of > n: emit only the final, ranked result
    last_emit: float | None = None  # metrics: when this request's previous output step went out

    @property
    def finished(self) -> bool:
        return all(s.state.finished for s in self.seqs)


def prompt_logprob_targets(state: RequestState, seq: Sequence, num_tokens: int) -> list[int] | None:
    """The prompt tokens whose logprobs this step's chunk of ``seq`` should report, if any."""
    start = seq.num_computed_tokens
    if (seq.sampling.prompt_logprobs is None or seq.index != 0 or start >= seq.num_prompt_tokens
            or state.prompt_logprobs_done):
        return None
    return seq.token_ids[start + 1: min(start + num_tokens + 1, seq.num_prompt_tokens)]


def add_prompt_logprobs(state: RequestState, sched: ScheduledSeq, result: StepResult) -> None:
    """Record the prompt logprobs of one prefill chunk (after the scheduler advanced it).

    Entries go to their prompt position (entry 0 is the first token's ``None``), so a chunk
    computed again after a preemption replaces what it reported before instead of adding to it.
    """
    seq = sched.seq
    start = seq.num_computed_tokens - sched.num_tokens
    logprobs = result.prompt_logprobs or []
    collected = state.prompt_logprobs if state.prompt_logprobs is not None else []
    targets = seq.token_ids[start + 1: start + 1 + len(logprobs)]
    ranks: list[int | None] = list(result.prompt_ranks or [])
    ranks += [None] * (len(targets) - len(ranks))
    for pos, (tok, (lp, top), rank) in enumerate(zip(targets, logprobs, ranks), start + 1):
        entry = TokenLogprob(tok, lp, top, rank)
        if pos < len(collected):
            collected[pos] = entry
        else:
            collected.append(entry)
    if len(collected) >= len(state.prompt_ids):
        state.prompt_logprobs_done = True


def append_token(seq: Sequence, result: StepResult, eos_ids: frozenset[int], max_model_len: int) -> bool:
    """Record one sampled token; return True when the sequence is now finished."""
    tok = result.token_id
    if tok is None:  # a prefill chunk that samples nothing
        return False
    st: SeqState = seq.state
    sp = seq.sampling
    seq.append_token(tok)
    st.cumulative_logprob += result.logprob
    delta = st.delta or SequenceDelta(index=seq.index, logprobs=[] if sp.logprobs is not None else None)
    st.delta = delta
    delta.token_ids.append(tok)
    if delta.logprobs is not None:
        delta.logprobs.append(TokenLogprob(tok, result.logprob, result.top or []))
    n_out = seq.num_output_tokens
    reason: FinishReason | None = None
    stop_reason: str | int | None = None
    if n_out >= sp.min_tokens:
        if tok in eos_ids and not sp.ignore_eos:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason, stop_reason = "stop", tok
    if reason is None or sp.include_stop_str_in_output:
        text = st.detok.add([tok])
        if st.budget is not None:
            st.budget.on_token(tok, text)
        if n_out > sp.min_tokens:
            text, matched = st.stop.feed(text)
            if matched is not None and reason is None:
                reason, stop_reason = "stop", matched
        delta.text += text
    if reason is None and (n_out >= st.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is None:
        return False
    if st.stop.matched is None:  # release text held back for a possible stop string
        tail = st.detok.flush()
        if n_out > sp.min_tokens:
            tail, matched = st.stop.feed(tail)
            if matched is not None:
                stop_reason = matched
        delta.text += tail + (st.stop.flush() if st.stop.matched is None else "")
    delta.finish_reason = reason
    delta.stop_reason = stop_reason
    st.finished = True
    return True


def build_output(state: RequestState) -> RequestOutput | None:
    """The event for what ``state``'s sequences produced since the last one (their pending
    deltas are taken); None while a best_of request is still running."""
    deltas = []
    for seq in state.seqs:
        st: SeqState = seq.state
        if st.delta is not None:
            st.delta.cumulative_logprob = st.cumulative_logprob
            st.delta.num_tokens = seq.num_output_tokens
            if state.buffered:
                st.text_parts.append(st.delta.text)
                st.all_logprobs += st.delta.logprobs or []
            deltas.append(st.delta)
            st.delta = None
    finished = state.finished
    out = RequestOutput(state.request.request_id, finished=finished, timings=state.timings)
    if state.buffered:
        if not finished:
            return None
        out.outputs = ranked(state, deltas)
    else:
        out.outputs = deltas
    if not state.first_sent:
        out.prompt_token_ids = state.prompt_ids
        out.prompt_logprobs = state.prompt_logprobs
        state.first_sent = True
    budgets = [s.state.budget.count for s in state.seqs if s.state.budget is not None]
    out.usage = Usage(prompt_tokens=len(state.prompt_ids),
                      completion_tokens=sum(s.num_output_tokens for s in state.seqs),
                      cached_tokens=state.seqs[0].num_cached_tokens,
                      reasoning_tokens=sum(budgets) if budgets else None)
    return out


def ranked(state: RequestState, last: list[SequenceDelta]) -> list[SequenceDelta]:
    """best_of: every sequence's whole output, best cumulative logprob first."""
    last_by_index = {d.index: d for d in last}
    full = []
    for seq in state.seqs:
        st: SeqState = seq.state
        d = last_by_index.get(seq.index)
        full.append(SequenceDelta(
            index=seq.index, token_ids=seq.output_token_ids, text="".join(st.text_parts),
            logprobs=st.all_logprobs if seq.sampling.logprobs is not None else None,
            finish_reason=d.finish_reason if d else "length", stop_reason=d.stop_reason if d else None,
            cumulative_logprob=st.cumulative_logprob, num_tokens=seq.num_output_tokens))
    full.sort(key=lambda d: d.cumulative_logprob, reverse=True)
    for i, d in enumerate(full):
        d.index = i
    return full
