"""The engine: schedule -> backend.step -> postprocess, one synchronous step at a time.

It turns requests into sequences, asks the scheduler what to run, hands the batch to the
backend, then lets ``postprocess`` turn sampled tokens into text and events, and sends one
``RequestOutput`` per touched request through the request's sink. Thread-agnostic: the
loop thread (``llmserve.engine.loop``) is the only caller.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from llmserve.config import CacheConfig, ServerConfig, SpeculativeConfig
from llmserve.engine.backend import Backend, KVCacheSpec, ModelInfo, StepItem, StepResult
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.budget import BudgetTracker
from llmserve.engine.defaults import SamplingDefaults
from llmserve.engine.embed import EmbedQueue
from llmserve.engine.faults import FailingMask, FaultInjector, InjectedFault
from llmserve.engine.limits import RequestLimits
from llmserve.engine.postprocess import (
    RequestState,
    SeqState,
    Sink,
    add_prompt_logprobs,
    append_token,
    build_output,
    prompt_logprob_targets,
)
from llmserve.engine.scheduler import ScheduledSeq, Scheduler
from llmserve.engine.sequence import Sequence
from llmserve.engine.speculation import DraftRequest, Proposer, SpecTracker, accept, room_for_drafts
from llmserve.engine.stats import EngineObserver, EngineStats
from llmserve.errors import ConfigError, GenerationError, InvalidRequestError, LLMServeError
from llmserve.media.inputs import started_before
from llmserve.outputs import RequestOutput, Timings
from llmserve.request import PreparedRequest
from llmserve.text.token_floor import max_token_span

log = logging.getLogger("llmserve.engine")


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


class LLMEngine:
    """Owns the scheduler and block manager; drives a backend. Of the configuration it reads the
    scheduler, cache and limits sections, and the model section's sampling defaults."""

    def __init__(self, backend: Backend, info: ModelInfo, config: ServerConfig,
                 proposer: Proposer | None = None) -> None:
        cache, scheduler = config.cache, config.scheduler
        self.backend = backend
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.block_size = cache.block_size
        self.cache_dtype: str = cache.kv_cache_dtype
        self.metrics: EngineObserver | None = None  # attached by the server before the loop starts
        self.limits = RequestLimits.from_config(config.limits, self.max_model_len, max_token_span(self.tokenizer))
        self.defaults = SamplingDefaults.from_config(config.llm)  # --generation-config, --seed
        self.faults = FaultInjector.from_env()
        if self.faults.active:
            log.warning("fault injection is on (%s): for tests only", self.faults)
        budget = scheduler.max_num_batched_tokens
        self.embeds = EmbedQueue(budget)
        self.requests: dict[str, RequestState] = {}
        self.eos_ids = frozenset(info.eos_token_ids)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # Speculative decoding (engine.speculation): proposals verified by the backend's step.
        self.proposer = proposer if info.task != "embed" else None
        self.spec: SpecTracker | None = None
        self.spec_max_batch: int | None = None  # no proposals above this many running sequences
        if info.task == "embed":  # a pooling model: no KV cache, no decoding
            self.block_manager = BlockManager(1, self.block_size, False)
            self.scheduler = Scheduler(self.block_manager, 1, budget)
            return
        chunked = scheduler.enable_chunked_prefill
        # A hybrid model keeps a recurrent state per running sequence: one slot each, and as many
        # snapshots of prompts' states for the prefix cache to resume from.
        slots = scheduler.max_num_seqs if info.state_bytes else 0
        snapshots = slots if cache.enable_prefix_caching else 0
        num_blocks = self._init_kv_cache(cache, fit=config.llm.max_model_len is None, state_slots=slots,
                                         state_snapshots=snapshots)
        if self.max_model_len != info.max_model_len:  # the default context did not fit: shrunk to the pool
            info.max_model_len = self.max_model_len
            self.limits = RequestLimits.from_config(config.limits, self.max_model_len, max_token_span(self.tokenizer))
        if not chunked and budget < self.max_model_len:
            raise ConfigError(f"--max-num-batched-tokens ({budget}) must be at least the context length "
                              f"({self.max_model_len}) when chunked prefill is off")
        if snapshots:
            log.info("prefix caching: %s keeps a recurrent state per sequence (%.1f MiB); a cached prefix resumes "
                     "from the state saved at a prompt's last block boundary (%d saved states at most)",
                     info.name, info.state_bytes / 2**20, snapshots)
        self.block_manager = BlockManager(num_blocks, self.block_size, cache.enable_prefix_caching,
                                          state_slots=slots, state_snapshots=snapshots)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=scheduler.max_num_seqs,
                                   max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        if proposer is not None:
            if slots:
                raise ConfigError(f"--speculative-config: {info.name} keeps a recurrent state per sequence, which "
                                  "cannot take back rejected proposals; serve it without speculative decoding")
            if not backend.verifies_drafts:
                raise ConfigError(f"--speculative-config: the {type(backend).__name__} backend does not verify "
                                  "proposed tokens; serve without speculative decoding")
            spec = scheduler.speculative_config or SpeculativeConfig(method=type(proposer).__name__)
            self.spec = SpecTracker(spec.num_speculative_tokens)
            self.spec_max_batch = spec.disable_by_batch_size or proposer.max_batch
            proposer.reserve(num_blocks, self.block_size, budget)

    def _init_kv_cache(self, cache: CacheConfig, fit: bool, state_slots: int = 0, state_snapshots: int = 0) -> int:
        """Have the backend allocate the KV pool; refuse a pool that cannot hold one request of
        ``max_model_len`` tokens. The check lives here, not in each backend, so every backend
        gets it the same way. With ``fit`` (no --max-model-len given: the length is the model's
        trained context) a pool too small for it shrinks the context to what the pool holds,
        as llama.cpp's and Ollama's defaults do, rather than refusing to start."""
        min_blocks = math.ceil(self.max_model_len / self.block_size)
        spec = KVCacheSpec(block_size=self.block_size, num_blocks=cache.num_kv_blocks,
                           memory_fraction=cache.kv_cache_memory_fraction, min_blocks=min_blocks,
                           state_slots=state_slots, state_snapshots=state_snapshots)
        num_blocks = self.backend.init_kv_cache(spec)
        if fit and 0 < num_blocks < min_blocks:
            held = num_blocks * self.block_size
            log.warning("context %d tokens, not the model's trained %d: the KV cache holds %d blocks x %d tokens "
                        "= %d tokens and one request must fit in it (raise --kv-cache-memory-fraction or "
                        "--num-kv-blocks for more, or set --max-model-len)", held, self.max_model_len,
                        num_blocks, self.block_size, held)
            self.max_model_len = held
        elif num_blocks < min_blocks:
            raise ConfigError(
                f"the KV cache holds {num_blocks * self.block_size} tokens but one request may need "
                f"{self.max_model_len}; use a smaller --max-model-len or a bigger KV pool "
                f"(--num-kv-blocks / --kv-cache-memory-fraction)")
        log.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, self.block_size,
                 num_blocks * self.block_size)
        return num_blocks

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: PreparedRequest, sink: Sink) -> None:
        """Queue a prepared request (``EngineClient.prepare``: tokenized, validated, its
        ``max_tokens`` set). Errors are delivered through ``sink``; an exception raised here is
        the engine's failure (the loop dies), not the request's."""
        self.faults.check_add(request.request_id)
        prompt_ids = list(request.prompt_token_ids)
        sp = request.sampling
        if request.request_id in self.requests:
            sink(RequestOutput(request.request_id, finished=True,
                               error=InvalidRequestError(f"request id {request.request_id!r} is already in use",
                                                         param="request_id")))
            return
        max_tokens = sp.max_tokens or (self.max_model_len - len(prompt_ids))  # set by prepare; a guard
        arrival = time.time()
        try:
            masks = [self._mask(request) for _ in range(sp.num_sequences)]
        except Exception:  # a broken mask plugin fails this request only
            log.exception("request %s: building its logits mask failed", request.request_id)
            sink(RequestOutput(request.request_id, finished=True, error=request_failed()))
            return
        seqs = []
        for j in range(sp.num_sequences):
            seq = Sequence(request.request_id, prompt_ids, sp, index=j, priority=request.priority,
                           arrival=arrival, mask=masks[j], media=request.media)
            seq.state = SeqState.new(self.tokenizer, prompt_ids, sp, max_tokens)
            if request.reasoning_budget is not None:
                seq.state.budget = BudgetTracker(request.reasoning_budget)
            seqs.append(seq)
        state = RequestState(request, prompt_ids, seqs, sink, Timings(arrival=arrival),
                             buffered=sp.num_sequences > sp.n)
        if sp.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request.request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)

    def _mask(self, request: PreparedRequest) -> GuardedMask | None:
        if self.faults.fails_mask(request.request_id):
            return GuardedMask(FailingMask())
        return GuardedMask(request.mask_factory()) if request.mask_factory else None

    def abort(self, request_id: str, reason: str = "abort", error: LLMServeError | None = None) -> None:
        """Finish every sequence of a request now and free its blocks (no-op if unknown).

        ``reason`` is the finish reason the metrics count ("length" for a request the client
        cut at its deadline after output); with ``error`` the request fails with it instead.
        """
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            self.scheduler.abort(seq)
        self._release([s.seq_id for s in state.seqs])
        self._count_finished(state, "error" if error is not None else reason,
                             sum(s.num_output_tokens for s in state.seqs))
        if error is not None:
            state.sink(RequestOutput(request_id, finished=True, error=error, timings=state.timings))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.embeds)

    def add_embed(self, inputs: list[list[int]], done: Callable[[Any], None]) -> None:
        """Queue token-id lists for pooling; ``done`` gets the vectors or an exception."""
        self.embeds.add(inputs, done)

    def check_idle(self) -> bool:
        """Invariant check for tests: no request records, every block free."""
        assert not self.requests, f"request records left: {list(self.requests)[:5]}"
        return self.scheduler.check_idle()

    def snapshot(self) -> EngineStats:
        """The counters as they are now (call on the engine thread; see ``EngineStats``)."""
        blocks = self.block_manager
        return EngineStats(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
            kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks, kv_blocks_total=blocks.num_blocks,
            prefix_queried_tokens=blocks.prefix_queried_tokens, prefix_hit_tokens=blocks.prefix_hit_tokens,
            preemptions=self.scheduler.num_preemptions_total, prompt_tokens=self.stats["prompt_tokens"],
            generation_tokens=self.stats["generation_tokens"], steps=self.stats["steps"],
            block_size=self.block_size, prefix_caching=blocks.enable_prefix_caching, cache_dtype=self.cache_dtype,
            state_slots_used=blocks.state_slots.num_used if blocks.state_slots else 0,
            state_slots_total=blocks.state_slots.num_slots if blocks.state_slots else 0,
            encoder_queries=getattr(self.info.media, "encoder_queries", 0),
            encoder_hits=getattr(self.info.media, "encoder_hits", 0),
            **(self.spec.counters() if self.spec is not None else {}))

    def _count_finished(self, state: RequestState, reason: str, generated: int, now: float | None = None) -> None:
        """Record a finished request in the metrics, with its parameters (engine thread)."""
        if self.metrics is not None:
            self.metrics.request_finished(reason, state.timings, len(state.prompt_ids), generated, now,
                                          n=state.request.sampling.n,
                                          max_tokens=state.seqs[0].state.max_tokens if state.seqs else None,
                                          preemptions=sum(s.num_preemptions for s in state.seqs))

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> None:
        if self.embeds:
            self.stats["prompt_tokens"] += self.embeds.run(self.backend)
        now = time.time()
        if self.proposer is not None:
            self._propose()
        scheduled = self._schedule(now)
        if not scheduled:
            return
        items = [self._item(s) for s in scheduled]
        self.faults.check_step(self.stats["steps"] + 1)
        results = self.backend.step(items)  # an exception here is fatal: the loop reports it
        self.stats["steps"] += 1
        emitted = {i: self._verified(s, r) for i, (s, r) in enumerate(zip(scheduled, results)) if s.drafts}
        self.scheduler.on_step_done(scheduled)
        self.block_manager.commit_snapshots()
        step_tokens = 0
        touched: dict[str, RequestState] = {}
        finished: list[Sequence] = []
        failed: set[str] = set()
        now = time.time()
        for i, (sched, result) in enumerate(zip(scheduled, results)):
            seq = sched.seq
            state = self.requests.get(seq.request_id)
            if state is None or seq.request_id in failed:
                continue
            try:  # one request's failure (mask, detokenizer, stop check) must not end the others
                if isinstance(seq.mask, GuardedMask) and seq.mask.error is not None:
                    raise seq.mask.error
                self.faults.check_request(seq.request_id)
                if result.prompt_logprobs is not None and not state.prompt_logprobs_done:
                    add_prompt_logprobs(state, sched, result)
                if result.token_id is None:
                    continue
                tokens = emitted.get(i, [result])
                if state.timings.first_token is None:
                    state.timings.first_token = now
                touched[seq.request_id] = state
                # vllm:iteration_tokens_total counts as vLLM does: a sequence's whole prompt once, in the
                # step of its first token, plus every generated token. The total for a workload then does
                # not depend on how its prefills were chunked or what the prefix cache held at the time.
                step_tokens += seq.num_prompt_tokens if seq.num_output_tokens == 0 else 0
                appended, done = self._append(seq, tokens)
                step_tokens += appended
                if done:
                    finished.append(seq)
                elif sched.drafts:
                    self.scheduler.on_verified(seq, appended - 1)  # the proposals that stood have their KV too
            except Exception as exc:  # logged, the request fails alone
                log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc,
                          exc_info=not isinstance(exc, InjectedFault))
                failed.add(seq.request_id)
        if self.metrics is not None:
            self.metrics.iteration(step_tokens)
        for seq in finished:
            self.scheduler.finish(seq)
        if finished:
            self._release([s.seq_id for s in finished])
        for rid in failed:
            touched.pop(rid, None)
            self.abort(rid, error=request_failed())
        for state in touched.values():
            try:
                self._emit(state)
            except Exception:  # same isolation for assembling the event
                log.exception("request %s failed while assembling its output", state.request.request_id)
                self.abort(state.request.request_id, error=request_failed())

    def _schedule(self, now: float) -> list[ScheduledSeq]:
        """The scheduler's batch; what it can never hold fails, and queue time ends for the
        requests that first enter a batch."""
        scheduled = self.scheduler.schedule()
        for seq in self.scheduler.unschedulable:
            self.abort(seq.request_id, error=InvalidRequestError(
                "the request needs more KV-cache blocks than the server has; lower max_tokens or the prompt length",
                param="max_tokens"))
        for sched in scheduled:
            state = self.requests.get(sched.seq.request_id)
            if state is not None and state.timings.scheduled is None:
                state.timings.scheduled = now
        return scheduled

    def _append(self, seq: Sequence, tokens: list[StepResult]) -> tuple[int, bool]:
        """Record ``tokens`` (one, or several from a verified step) in order until one finishes
        the sequence: (tokens recorded, finished)."""
        for n, token in enumerate(tokens, 1):
            self.stats["generation_tokens"] += 1
            if append_token(seq, token, self.eos_ids, self.max_model_len):
                return n, True
        return len(tokens), False

    def _item(self, sched: ScheduledSeq) -> StepItem:
        seq = sched.seq
        sp = seq.sampling
        start = seq.num_computed_tokens
        state = self.requests.get(seq.request_id)
        targets = prompt_logprob_targets(state, seq, sched.num_tokens) if state is not None else None
        mask = seq.mask
        budget = seq.state.budget
        if budget is not None and budget.forcing and sched.sample:
            mask = budget  # a spent thinking budget: the next token of its end marker, whatever the logits
        fed = seq.token_ids[start: start + sched.num_tokens - len(sched.drafts)] + sched.drafts
        item = StepItem(
            seq_id=seq.seq_id, token_ids=fed, start_pos=start, num_draft_tokens=len(sched.drafts),
            block_table=seq.block_table, sample=sched.sample, sampling=sp,
            prompt_ids=seq.prompt_token_ids if sp.repetition_penalty != 1.0 else [],
            output_ids=seq.output_token_ids, seed_offset=seq.index, mask=mask,
            prompt_logprob_targets=targets, media=started_before(seq.media, start + len(fed)) if seq.media else ())
        if seq.state_slot is not None:  # a hybrid model: its recurrent state's slot, restore and save
            item.state_slot = seq.state_slot
            if seq.state_restore is not None:  # the first step after a prefix hit
                item.state_restore, seq.state_restore = seq.state_restore, None
            item.state_snapshot = self.block_manager.plan_snapshot(seq, start, len(fed))
        return item

    # -- speculative decoding ---------------------------------------------------------------
    def _propose(self) -> None:
        """Ask the proposer for the running sequences that decode this step (``Sequence.draft``):
        not those under a logits mask or a thinking budget (their masks follow the tokens one by
        one), nor before their first output token."""
        assert self.proposer is not None and self.spec is not None
        asks: list[tuple[Sequence, DraftRequest]] = []
        crowded = self.spec_max_batch is not None and len(self.scheduler.running) > self.spec_max_batch
        for seq in self.scheduler.running:
            seq.draft = []
            if crowded:
                continue
            if (seq.num_tokens - seq.num_computed_tokens != 1 or not seq.num_output_tokens or seq.mask is not None
                    or seq.state.budget is not None or not seq.sampling.speculative):
                continue
            k = min(self.spec.k_for(seq.seq_id), room_for_drafts(seq, self.max_model_len))
            if k > 0:
                asks.append((seq, DraftRequest(seq.seq_id, seq.token_ids, k, seq.num_prompt_tokens)))
        if not asks:
            return
        try:
            drafts = self.proposer.propose([ask for _, ask in asks])
        except Exception:  # a broken proposer costs its proposals, never a request
            log.exception("the %s proposer failed; this step decodes without proposals", type(self.proposer).__name__)
            return
        vocab = self.info.vocab_size
        for (seq, ask), draft in zip(asks, drafts):
            seq.draft = [int(t) for t in draft[: ask.k] if 0 <= int(t) < vocab]

    def _verified(self, sched: ScheduledSeq, result: StepResult) -> list[StepResult]:
        """The tokens a verified step emits for ``sched``: its first sample, then one more per
        proposal that the samples confirmed (``speculation.accept``)."""
        assert self.spec is not None
        samples = [result, *(result.draft_samples or [])]
        if result.token_id is None or len(samples) != len(sched.drafts) + 1:
            raise GenerationError(f"the backend returned {len(samples) - 1} draft samples for "
                                  f"{len(sched.drafts)} proposed tokens")
        n = accept(sched.drafts, [s.token_id for s in samples])
        self.spec.record(sched.seq.seq_id, len(sched.drafts), n)
        sched.num_tokens -= len(sched.drafts)  # on_step_done counts the newest token; on_verified the rest
        return samples[: n + 1]

    def _release(self, seq_ids: list[int]) -> None:
        self.backend.release(seq_ids)
        if self.proposer is not None and self.spec is not None:
            self.proposer.release(seq_ids)
            self.spec.forget(seq_ids)

    def _emit(self, state: RequestState) -> None:
        """Send ``state``'s new output; on its last event forget the request and count it."""
        out = build_output(state)
        if out is None:
            return
        if out.finished:
            state.timings.finished = time.time()
            self.requests.pop(state.request.request_id, None)
            self.stats["prompt_tokens"] += len(state.prompt_ids)
        if self.metrics is not None:  # plain counters and histograms: no locks on the engine thread
            now = time.time()
            if state.last_emit is not None:
                self.metrics.token_step(now - state.last_emit)
            state.last_emit = now
            if out.finished:
                reason = next((d.finish_reason for d in out.outputs if d.finish_reason), "stop")
                self._count_finished(state, reason, out.usage.completion_tokens, now)
        state.sink(out)
