"""The engine: schedule -> backend.step -> postprocess, one synchronous step at a time.

It turns requests into sequences, asks the scheduler what to run, hands the batch to the
backend, then appends sampled tokens, detokenizes, checks stop conditions and emits one
``RequestOutput`` per touched request through the request's sink. Thread-agnostic: the
loop thread (``llmserve.engine.loop``) is the only caller.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from llmserve.engine.backend import Backend, KVCacheSpec, ModelInfo, StepItem, StepResult
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.faults import FailingMask, FaultInjector, InjectedFault
from llmserve.engine.scheduler import ScheduledSeq, Scheduler
from llmserve.engine.sequence import Sequence
from llmserve.errors import ConfigError, GenerationError, InvalidRequestError, LLMServeError
from llmserve.outputs import RequestOutput, SequenceDelta, Timings, TokenLogprob, Usage
from llmserve.request import GenerateRequest
from llmserve.text.detokenizer import IncrementalDetokenizer
from llmserve.text.stop import StopChecker

log = logging.getLogger("llmserve.engine")
Sink = Callable[[RequestOutput], None]


def request_failed() -> GenerationError:
    # The cause goes to the log; clients get a message without internals.
    return GenerationError("generation failed for this request; see the server log")


class GuardedMask:
    """Wraps a request's logits mask so that its failure fails that request, not the step.

    The backend calls ``allowed`` in the middle of a batched step; an exception there would
    take the whole batch (and the engine loop) down. Instead the error is kept, the sequence
    is left unrestricted for this one token, and the engine fails the request after the step.
    """

    __slots__ = ("inner", "error")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.error: BaseException | None = None

    def allowed(self, output_token_ids: list[int]) -> list[int] | None:
        if self.error is not None:
            return None
        try:
            return self.inner.allowed(output_token_ids)
        except Exception as exc:  # noqa: BLE001 - reported after the step, for this request only
            self.error = exc
            return None


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


@dataclass(slots=True)
class RequestState:
    request: GenerateRequest
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


class LLMEngine:
    """Owns the scheduler and block manager; drives a backend."""

    def __init__(self, backend: Backend, info: ModelInfo, config: Any) -> None:
        self.backend = backend
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.block_size = int(getattr(config, "block_size", 16))
        self.metrics: Any = None  # llmserve.server.metrics.Metrics, attached by the server
        self.faults = FaultInjector.from_env()
        if self.faults.active:
            log.warning("fault injection is on (%s): for tests only", self.faults)
        self.pending_embeds: list[tuple[list[list[int]], Callable[[Any], None]]] = []
        self.embed_budget = int(getattr(config, "max_num_batched_tokens", 2048))
        if info.task == "embed":  # a pooling model: no KV cache, no decoding
            self.block_manager = BlockManager(1, self.block_size, False)
            self.scheduler = Scheduler(self.block_manager, 1, self.embed_budget)
            self.requests: dict[str, RequestState] = {}
            self.eos_ids = frozenset(info.eos_token_ids)
            self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
            return
        min_blocks = math.ceil(self.max_model_len / self.block_size)
        spec = KVCacheSpec(block_size=self.block_size, num_blocks=getattr(config, "num_kv_blocks", None),
                           memory_fraction=getattr(config, "kv_cache_memory_fraction", 0.25),
                           min_blocks=min_blocks)
        chunked = bool(getattr(config, "enable_chunked_prefill", True))
        budget = int(getattr(config, "max_num_batched_tokens", 2048))
        if not chunked and budget < self.max_model_len:
            raise ConfigError(f"--max-num-batched-tokens ({budget}) must be at least the context length "
                              f"({self.max_model_len}) when chunked prefill is off")
        num_blocks = backend.init_kv_cache(spec)
        if num_blocks < min_blocks:
            raise ConfigError(
                f"the KV cache holds {num_blocks * self.block_size} tokens but one request may need "
                f"{self.max_model_len}; use a smaller --max-model-len or a bigger KV pool "
                f"(--num-kv-blocks / --kv-cache-memory-fraction)")
        log.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, self.block_size,
                 num_blocks * self.block_size)
        self.block_manager = BlockManager(num_blocks, self.block_size,
                                          bool(getattr(config, "enable_prefix_caching", True)))
        self.scheduler = Scheduler(self.block_manager,
                                   max_num_seqs=int(getattr(config, "max_num_seqs", 64)),
                                   max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        self.requests: dict[str, RequestState] = {}
        self.eos_ids = frozenset(info.eos_token_ids)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest, prompt_ids: list[int], sink: Sink) -> None:
        """Queue a validated, tokenized request. Errors are delivered through ``sink``."""
        sp = request.sampling
        if request.request_id in self.requests:
            sink(RequestOutput(request.request_id, finished=True,
                               error=InvalidRequestError(f"request id {request.request_id!r} is already in use",
                                                         param="request_id")))
            return
        max_tokens = sp.max_tokens or (self.max_model_len - len(prompt_ids))
        arrival = time.time()
        try:
            masks = [self._mask(request) for _ in range(sp.num_sequences)]
        except Exception:  # noqa: BLE001 - a broken mask plugin fails this request only
            log.exception("request %s: building its logits mask failed", request.request_id)
            sink(RequestOutput(request.request_id, finished=True, error=request_failed()))
            return
        seqs = []
        for j in range(sp.num_sequences):
            seq = Sequence(request.request_id, prompt_ids, sp, index=j, priority=request.priority,
                           arrival=arrival, mask=masks[j])
            seq.state = SeqState(
                detok=IncrementalDetokenizer(self.tokenizer, prompt_ids, sp.skip_special_tokens,
                                             sp.spaces_between_special_tokens),
                stop=StopChecker(sp.stop, sp.include_stop_str_in_output), max_tokens=max_tokens)
            seqs.append(seq)
        state = RequestState(request, prompt_ids, seqs, sink, Timings(arrival=arrival),
                             buffered=sp.num_sequences > sp.n)
        if sp.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request.request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)

    def _mask(self, request: GenerateRequest) -> GuardedMask | None:
        if self.faults.fails_mask(request.request_id):
            return GuardedMask(FailingMask())
        return GuardedMask(request.mask_factory()) if request.mask_factory else None

    def abort(self, request_id: str, reason: str = "abort", error: LLMServeError | None = None) -> None:
        """Finish every sequence of a request now and free its blocks (no-op if unknown)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            self.scheduler.abort(seq)
        self.backend.release([s.seq_id for s in state.seqs])
        if self.metrics is not None:
            self.metrics.request_finished("error" if error is not None else "abort", state.timings,
                                          len(state.prompt_ids), sum(s.num_output_tokens for s in state.seqs))
        if error is not None:
            state.sink(RequestOutput(request_id, finished=True, error=error, timings=state.timings))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.pending_embeds)

    def add_embed(self, inputs: list[list[int]], done: Callable[[Any], None]) -> None:
        """Queue token-id lists for pooling; ``done`` gets the vectors or an exception."""
        self.pending_embeds.append((inputs, done))

    def _run_embeds(self) -> None:
        """Pool queued inputs in batches of at most ``max_num_batched_tokens`` tokens."""
        while self.pending_embeds:
            batch, tokens = [], 0
            while self.pending_embeds and (not batch or tokens + sum(map(len, self.pending_embeds[0][0])) <= self.embed_budget):
                inputs, done = self.pending_embeds.pop(0)
                batch.append((inputs, done))
                tokens += sum(map(len, inputs))
            flat = [ids for inputs, _ in batch for ids in inputs]
            try:
                vectors = self.backend.embed(flat)
            except Exception as exc:  # noqa: BLE001 - fails these requests only
                log.exception("embedding batch failed")
                for _, done in batch:
                    done(exc)
                continue
            start = 0
            for inputs, done in batch:
                done(vectors[start:start + len(inputs)])
                start += len(inputs)
            self.stats["prompt_tokens"] += tokens

    def check_idle(self) -> bool:
        """Invariant check for tests: no request records, every block free."""
        assert not self.requests, f"request records left: {list(self.requests)[:5]}"
        return self.scheduler.check_idle()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> None:
        if self.pending_embeds:
            self._run_embeds()
        now = time.time()
        self._expire(now)
        scheduled = self.scheduler.schedule()
        for seq in self.scheduler.unschedulable:
            self.abort(seq.request_id, error=InvalidRequestError(
                "the request needs more KV-cache blocks than the server has; lower max_tokens or the prompt length",
                param="max_tokens"))
        if not scheduled:
            return
        for sched in scheduled:  # queue time ends when a request first enters a batch
            state = self.requests.get(sched.seq.request_id)
            if state is not None and state.timings.scheduled is None:
                state.timings.scheduled = now
        items = [self._item(s) for s in scheduled]
        self.faults.check_step(self.stats["steps"] + 1)
        results = self.backend.step(items)  # an exception here is fatal: the loop reports it
        self.stats["steps"] += 1
        self.scheduler.on_step_done(scheduled)
        touched: dict[str, RequestState] = {}
        finished: list[Sequence] = []
        failed: set[str] = set()
        now = time.time()
        for sched, result in zip(scheduled, results):
            seq = sched.seq
            state = self.requests.get(seq.request_id)
            if state is None or seq.request_id in failed:
                continue
            try:  # one request's failure (mask, detokenizer, stop check) must not end the others
                if isinstance(seq.mask, GuardedMask) and seq.mask.error is not None:
                    raise seq.mask.error
                self.faults.check_request(seq.request_id)
                if result.prompt_logprobs is not None and not state.prompt_logprobs_done:
                    self._add_prompt_logprobs(state, sched, result)
                if result.token_id is not None:
                    if state.timings.first_token is None:
                        state.timings.first_token = now
                    if self._append(seq, result):
                        finished.append(seq)
                    touched[seq.request_id] = state
            except Exception as exc:  # noqa: BLE001 - logged, the request fails alone
                log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc,
                          exc_info=not isinstance(exc, InjectedFault))
                failed.add(seq.request_id)
        for seq in finished:
            self.scheduler.finish(seq)
        if finished:
            self.backend.release([s.seq_id for s in finished])
        for rid in failed:
            touched.pop(rid, None)
            self.abort(rid, error=request_failed())
        for state in touched.values():
            try:
                self._emit(state)
            except Exception:  # noqa: BLE001 - same isolation for assembling the event
                log.exception("request %s failed while assembling its output", state.request.request_id)
                self.abort(state.request.request_id, error=request_failed())

    def _item(self, sched: ScheduledSeq) -> StepItem:
        seq = sched.seq
        sp = seq.sampling
        start = seq.num_computed_tokens
        targets = None
        if sp.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens:
            state = self.requests.get(seq.request_id)
            if state is not None and not state.prompt_logprobs_done:
                targets = seq.token_ids[start + 1: min(start + sched.num_tokens + 1, seq.num_prompt_tokens)]
        return StepItem(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start: start + sched.num_tokens], start_pos=start,
            block_table=seq.block_table, sample=sched.sample, sampling=sp,
            prompt_ids=seq.prompt_token_ids if sp.repetition_penalty != 1.0 else [],
            output_ids=seq.output_token_ids, seed_offset=seq.index, mask=seq.mask,
            prompt_logprob_targets=targets)

    def _add_prompt_logprobs(self, state: RequestState, sched: ScheduledSeq, result: StepResult) -> None:
        seq = sched.seq
        start = seq.num_computed_tokens - sched.num_tokens  # on_step_done already advanced it
        targets = seq.token_ids[start + 1: start + 1 + len(result.prompt_logprobs)]
        for tok, (lp, top) in zip(targets, result.prompt_logprobs):
            state.prompt_logprobs.append(TokenLogprob(tok, lp, top))
        if len(state.prompt_logprobs) >= len(state.prompt_ids):
            state.prompt_logprobs_done = True

    def _append(self, seq: Sequence, result: StepResult) -> bool:
        """Record one sampled token; return True when the sequence is now finished."""
        st: SeqState = seq.state
        sp = seq.sampling
        tok = result.token_id
        seq.append_token(tok)
        self.stats["generation_tokens"] += 1
        st.cumulative_logprob += result.logprob
        delta = st.delta or SequenceDelta(index=seq.index, logprobs=[] if sp.logprobs is not None else None)
        st.delta = delta
        delta.token_ids.append(tok)
        if delta.logprobs is not None:
            delta.logprobs.append(TokenLogprob(tok, result.logprob, result.top or []))
        n_out = seq.num_output_tokens
        reason = stop_reason = None
        if n_out >= sp.min_tokens:
            if tok in self.eos_ids and not sp.ignore_eos:
                reason = "stop"
            elif tok in sp.stop_token_ids:
                reason, stop_reason = "stop", tok
        if reason is None or sp.include_stop_str_in_output:
            text = st.detok.add([tok])
            if n_out > sp.min_tokens:
                text, matched = st.stop.feed(text)
                if matched is not None and reason is None:
                    reason, stop_reason = "stop", matched
            delta.text += text
        if reason is None and (n_out >= st.max_tokens or seq.num_tokens >= self.max_model_len):
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

    def _emit(self, state: RequestState) -> None:
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
                return
            out.outputs = self._ranked(state, deltas)
        else:
            out.outputs = deltas
        if not state.first_sent:
            out.prompt_token_ids = state.prompt_ids
            out.prompt_logprobs = state.prompt_logprobs
            state.first_sent = True
        seq0 = state.seqs[0]
        out.usage = Usage(prompt_tokens=len(state.prompt_ids),
                          completion_tokens=sum(s.num_output_tokens for s in state.seqs),
                          cached_tokens=seq0.num_cached_tokens)
        if finished:
            state.timings.finished = time.time()
            self.requests.pop(state.request.request_id, None)
            self.stats["prompt_tokens"] += len(state.prompt_ids)
        if self.metrics is not None:  # plain counters and histograms: no locks on the engine thread
            now = time.time()
            if state.last_emit is not None:
                self.metrics.token_step(now - state.last_emit)
            state.last_emit = now
            if finished:
                reason = next((d.finish_reason for d in deltas if d.finish_reason), "stop")
                self.metrics.request_finished(reason, state.timings, len(state.prompt_ids),
                                              out.usage.completion_tokens, now)
        state.sink(out)

    def _ranked(self, state: RequestState, last: list[SequenceDelta]) -> list[SequenceDelta]:
        """best_of: every sequence's whole output, best cumulative logprob first."""
        last_by_index = {d.index: d for d in last}
        full = []
        for seq in state.seqs:
            st: SeqState = seq.state
            d = last_by_index.get(seq.index)
            full.append(SequenceDelta(
                index=seq.index, token_ids=seq.output_token_ids, text="".join(st.text_parts),
                logprobs=st.all_logprobs if seq.sampling.logprobs is not None else None, finish_reason=d.finish_reason if d else "length",
                stop_reason=d.stop_reason if d else None, cumulative_logprob=st.cumulative_logprob,
                num_tokens=seq.num_output_tokens))
        full.sort(key=lambda d: d.cumulative_logprob, reverse=True)
        for i, d in enumerate(full):
            d.index = i
        return full

    def _expire(self, now: float) -> None:
        """Finish requests past their deadline: 'length' if they produced output, else an error."""
        for rid, state in list(self.requests.items()):
            deadline = state.request.deadline
            if deadline is None or now < deadline:
                continue
            if any(s.num_output_tokens for s in state.seqs) and not state.buffered:
                for seq in state.seqs:
                    st: SeqState = seq.state
                    if not st.finished:
                        st.finished = True
                        st.delta = st.delta or SequenceDelta(index=seq.index)
                        st.delta.finish_reason = "length"
                        self.scheduler.finish(seq)
                self.backend.release([s.seq_id for s in state.seqs])
                self._emit(state)
            else:
                self.abort(rid, error=GenerationError("request timed out before producing output", status=408))
