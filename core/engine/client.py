"""The asyncio client that protocols call; the engine itself runs on ``EngineLoop``'s thread.

The event loop only queues commands and awaits events. ``generate()`` is an async iterator
of ``RequestOutput``; leaving it early (client gone, task cancelled) aborts the request on
the engine thread. It is also where deadlines are enforced (see ``generate``), and where the
per-request bounds of ``RequestLimits`` are checked before tokenizing; tokenizing itself runs
in worker threads (``aencode`` / ``aprepare``), so a long prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, TypeVar

from llmserve.engine.engine import LLMEngine
from llmserve.engine.loop import EngineLoop
from llmserve.engine.stats import EngineStats
from llmserve.errors import ContextLengthError, EngineDeadError, InvalidRequestError, LLMServeError, RequestTimeoutError
from llmserve.outputs import RequestOutput, SequenceDelta
from llmserve.engine.prepare import Preparer
from llmserve.request import REJECT, GenerateRequest, PreparedRequest, RequestPolicy
from llmserve.request_context import current_context

log = logging.getLogger("llmserve.engine")
T = TypeVar("T")
# Fast tokenizers release the GIL while they work, so two threads tokenize two prompts at once
# while the event loop keeps serving; more would only compete with the engine thread for cores.
TOKENIZE_THREADS = 2


class EngineClient:
    """What protocols use: ``generate()``, ``abort()``, ``encode()`` and model facts."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.info.tokenizer
        self.max_model_len = engine.max_model_len
        self.limits = engine.limits
        self.preparer = Preparer(self._tokenize, engine.info.vocab_size, engine.max_model_len, engine.limits,
                                 engine.defaults, media=engine.info.media)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="llmserve-tokenize")
        self.refusal: LLMServeError | None = None  # set when shutdown aborted everything
        self.loop = EngineLoop(engine)
        self.loop.start()

    @property
    def is_dead(self) -> bool:
        return self.loop.error is not None or not self.loop.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest iteration: cheap, lock-free, one consistent set."""
        snapshot = self.loop.stats
        if self.is_dead and not snapshot.dead:
            return replace(snapshot, running=0, waiting=0, dead=True)
        return snapshot

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` on the engine thread once, if the engine loop dies."""
        self.loop.on_death.append(callback)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of ``text``; a text over ``--max-prompt-chars`` is refused (400) untokenized.
        Blocks while it tokenizes: from the event loop, await ``aencode`` instead."""
        self.limits.check_prompt(text, param)
        return self._tokenize(text, add_special_tokens)

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def in_worker(self, func: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run ``func`` (tokenizer work) in a tokenizer thread and await its result, in a copy of
        the caller's context (as ``asyncio.to_thread`` does): the HTTP request's context, which
        e.g. collects its response's warnings, is then the one ``func`` sees."""
        aio = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
        return await aio.run_in_executor(self._tokenize_pool, call)

    async def aencode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """``encode`` off the event loop: the size check here, the tokenizing in a worker thread."""
        self.limits.check_prompt(text, param)
        return await self.in_worker(self._tokenize, text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def check_limits(self, request: GenerateRequest, policy: RequestPolicy = REJECT) -> None:
        """The bounds that hold before any tokenizing: prompt characters, stop strings (400)."""
        self.preparer.check_limits(request, policy)

    def prepare(self, request: GenerateRequest, policy: RequestPolicy = REJECT) -> PreparedRequest:
        """Tokenize, fit and validate ``request`` under the dialect's ``policy``: the one
        ``PreparedRequest`` that ``generate`` takes (``engine/prepare.py``).

        Protocols prepare before answering, so a bad request fails with a status code instead
        of in the middle of a stream. It blocks while it tokenizes: from the event loop, await
        ``aprepare`` instead.
        """
        return self.preparer.prepare(request, policy)

    async def aprepare(self, request: GenerateRequest, policy: RequestPolicy = REJECT) -> PreparedRequest:
        """``prepare`` off the event loop: the bounds are checked here, at once, and only a
        request within them is tokenized, in a worker thread."""
        self.preparer.check_limits(request, policy)
        if request.prompt_token_ids is not None and not request.sampling.bad_words:
            return self.preparer.prepare(request, policy)  # nothing to tokenize: no worker needed
        return await self.in_worker(self.preparer.prepare, request, policy)

    async def embed(self, inputs: list[list[int]], param: str = "input") -> list[list[float]]:
        """Pooled embeddings of token-id lists (an embedding model, ``--task embed``)."""
        if self.info.task != "embed":
            raise InvalidRequestError("the served model does not compute embeddings; start a server with "
                                      "--task embed and an embedding model", param=param)
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        for ids in inputs:
            if not ids:
                raise InvalidRequestError("input must not be empty", param=param)
            if len(ids) > self.max_model_len:
                raise ContextLengthError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                    f"has {len(ids)} input tokens. Please reduce the length of the input.", tokens=len(ids),
                    limit=self.max_model_len, param=param)
            bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} is out of vocabulary (vocab size {self.info.vocab_size})",
                                          param=param)
        aio = asyncio.get_running_loop()
        fut: asyncio.Future = aio.create_future()

        def done(result: object) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
            try:
                aio.call_soon_threadsafe(settle)
            except RuntimeError:
                pass

        def add() -> None:
            try:
                self.engine.add_embed(inputs, done)
            except BaseException:
                done(EngineDeadError("the engine failed and is restarting; retry the request"))
                raise  # the loop dies of it and reports it

        self.loop.submit(add)
        return await fut

    async def generate(self, request: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Run ``request`` (from ``prepare``); yield its events until the finished one. Raises
        core errors.

        Deadlines are enforced here and nowhere else: ``request.deadline`` (the request's own
        budget, e.g. MindIE's and Triton's ``timeout``) and the HTTP request's
        ``--request-timeout`` (``RequestContext.deadline``), both on ``time.monotonic()``. Here,
        not on the engine thread, because this is the one place that sees both, and an asyncio
        timer fires on time even while the engine thread is inside a long step. At the earlier
        of the two the request is aborted (its blocks are free before the engine's next step):
        a request past its own deadline finishes with "length" if it produced output, else
        fails with ``RequestTimeoutError``; the server's ``--request-timeout`` is a hard limit
        that fails it with ``RequestTimeoutError`` even after output (in-band on streams).
        """
        if self.info.task == "embed":
            raise InvalidRequestError("this server runs an embedding model (--task embed); it serves "
                                      "/v1/embeddings, /score and /rerank, not generation", param="model")
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        if self.refusal is not None:
            raise self.refusal
        prompt_ids = request.prompt_token_ids
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()  # None: the deadline passed
        ctx = current_context()  # the HTTP request's admission share, deadline and log counts, if any
        limit = ctx.deadline if ctx is not None else None
        deadline = min((d for d in (request.deadline, limit) if d is not None), default=None)

        def sink(out: RequestOutput) -> None:
            try:
                aio.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        def add() -> None:
            try:
                self.engine.add_request(request, sink)
            except BaseException:
                # The engine dies of this (the loop reports it and fails every request it
                # knows), but this request may not be known yet: answer it here, or its client
                # would wait forever and keep the dying server from exiting.
                sink(RequestOutput(request.request_id, finished=True, error=EngineDeadError(
                    "the engine failed and is restarting; retry the request")))
                raise

        self.loop.submit(add)
        pending_tokens = len(prompt_ids)  # waiting for prefill until the first event arrives
        if ctx is not None:
            ctx.add_waiting_tokens(pending_tokens)
        progress = _Progress()
        done = cut = False
        # The deadline arrives as an item of the queue, not as a wait_for timeout: on Python
        # 3.10 and 3.11 wait_for swallows a cancellation (the client left) that lands just as an
        # event arrives, and the request would then run to its end for nobody.
        timer = None if deadline is None else aio.call_later(max(0.0, deadline - time.monotonic()),
                                                             queue.put_nowait, None)
        try:
            while True:
                item = await queue.get()
                if item is None:
                    out = progress.past_deadline(request, hard=deadline == limit)  # or raises
                    cut = True
                else:
                    out = item
                if ctx is not None and pending_tokens:
                    ctx.remove_waiting_tokens(pending_tokens)
                    pending_tokens = 0
                if out.error is not None:
                    done = True
                    raise out.error
                if deadline is not None:  # only a deadline needs what was delivered so far
                    progress.add(out)
                if out.finished and ctx is not None:
                    ctx.note_output(out)  # token counts and timings for the request log line
                yield out
                if out.finished:
                    done = not cut  # a cut request still runs in the engine: abort it below
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if ctx is not None and pending_tokens:
                ctx.remove_waiting_tokens(pending_tokens)
            if not done:
                self.abort(request.request_id, "length" if cut else "abort")

    async def generate_many(self, requests: list[PreparedRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run several requests concurrently; yield ``(request index, event)`` as events arrive.

        Closing the iterator early cancels every request (each stream aborts itself); the first
        error of any request is raised.
        """
        if len(requests) == 1:  # the common case needs no tasks
            async for event in self.generate(requests[0]):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request: PreparedRequest) -> None:
            try:
                async for event in self.generate(request):
                    await queue.put((i, event, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, None, exc))
                return
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        remaining = len(tasks)
        try:
            while remaining:
                i, event, exc = await queue.get()
                if exc is not None:
                    raise exc
                if event is None:
                    remaining -= 1
                    continue
                yield i, event
        finally:
            for task in tasks:
                task.cancel()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop ``request_id`` and free its blocks; ``reason`` is what the metrics count it as."""
        try:
            self.loop.submit(lambda: self.engine.abort(request_id, reason))
        except EngineDeadError:
            pass  # a dead engine already failed (and forgot) every request

    def abort_all(self, error: LLMServeError, refuse_new: bool = False) -> None:
        """Fail every request in the engine with ``error`` (shutdown past its timeout);
        with ``refuse_new``, later ``generate()`` calls fail with it too."""
        if refuse_new:
            self.refusal = error

        def command() -> None:
            for rid in list(self.engine.requests):
                self.engine.abort(rid, error=error)

        try:
            self.loop.submit(command)
        except EngineDeadError:
            pass

    def cached_prefix(self, token_ids: list[int], media: tuple[Any, ...] = ()) -> int:
        """How many leading prompt tokens (with images ``media``) the prefix cache holds now (an
        estimate: the blocks may be evicted before the request is admitted; its final usage says
        what was reused)."""
        return self.engine.block_manager.peek_prefix(token_ids, media)

    async def check_idle(self) -> bool:
        """Run the engine's idle invariant check on the engine thread (for tests)."""
        aio = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = aio.create_future()

        def check() -> None:
            try:
                result = self.engine.check_idle()
                aio.call_soon_threadsafe(fut.set_result, result)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                aio.call_soon_threadsafe(fut.set_exception, exc)

        self.loop.submit(check)
        return await fut

    def shutdown(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.loop.stop()
        self.loop.join(timeout=10)
        self.engine.backend.close()
        if self.engine.proposer is not None:
            self.engine.proposer.close()


class _Progress:
    """What a stream has delivered so far: enough to end it with "length" at its deadline."""

    __slots__ = ("produced", "finished", "last", "latest")

    def __init__(self) -> None:
        self.produced = False                   # some sequence delivered a token
        self.finished: set[int] = set()         # sequence indexes that already ended
        self.last: dict[int, SequenceDelta] = {}
        self.latest: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.latest = out
        for d in out.outputs:
            self.produced = self.produced or bool(d.token_ids)
            self.last[d.index] = d
            if d.finish_reason is not None:
                self.finished.add(d.index)

    def past_deadline(self, request: PreparedRequest, hard: bool) -> RequestOutput:
        """The final "length" event of a request cut at its own deadline after output; else
        raise the timeout error (no output yet, or the server's hard ``--request-timeout``)."""
        if hard:
            raise RequestTimeoutError("the request took longer than the server's request timeout and was aborted")
        if not self.produced or self.latest is None:  # a best_of request delivers nothing before its end
            raise RequestTimeoutError("request timed out before producing output")
        outputs = [SequenceDelta(index=i, finish_reason="length",
                                 cumulative_logprob=self.last[i].cumulative_logprob if i in self.last else 0.0,
                                 num_tokens=self.last[i].num_tokens if i in self.last else 0)
                   for i in range(request.sampling.n) if i not in self.finished]
        return RequestOutput(request.request_id, outputs=outputs, finished=True,
                             usage=replace(self.latest.usage), timings=self.latest.timings)
