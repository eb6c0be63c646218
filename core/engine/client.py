"""The engine thread and the asyncio client that protocols call.

The blocking ``backend.step`` runs only on the engine thread; the event loop only queues
commands and awaits events. ``generate()`` is an async iterator of ``RequestOutput``;
leaving it early (client gone, task cancelled) aborts the request on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from llmserve.engine.engine import LLMEngine
from llmserve.errors import EngineDeadError, InvalidRequestError, LLMServeError, RequestTimeoutError
from llmserve.outputs import RequestOutput
from llmserve.request import GenerateRequest
from llmserve.request_context import current_scope
from llmserve.request_log import note_output

log = logging.getLogger("llmserve.engine")


class EngineLoop(threading.Thread):
    """Runs queued commands and engine steps until stopped or dead.

    ``num_running`` / ``num_waiting`` are the scheduler's sequence counts after the latest
    step, written by this thread only (admission control reads them without a lock).
    ``on_death`` callables run on this thread once, right after the loop died.
    """

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(name="llmserve-engine", daemon=True)
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._dead = False
        self.error: BaseException | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.on_death: list[Callable[[BaseException], None]] = []

    def submit(self, command: Callable[[], None]) -> None:
        with self._cv:
            if self._dead:  # nobody would ever run it: fail now instead of hanging the caller
                raise EngineDeadError("the engine is not running; the server is restarting")
            self._inbox.append(command)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not engine.has_work and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    commands = list(self._inbox)
                    self._inbox.clear()
                for command in commands:
                    command()
                if engine.has_work:
                    engine.step()
                self.num_running = engine.scheduler.num_running
                self.num_waiting = engine.scheduler.num_waiting
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Tell the listeners, then fail every request (the queued commands' included)."""
        self.error = exc
        log.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        engine = self.engine
        with self._cv:
            self._dead = True
            leftover = list(self._inbox)
            self._inbox.clear()
        # Listeners first, so anyone who sees a request fail already sees the death recorded.
        for callback in list(self.on_death):
            try:
                callback(exc)
            except Exception:  # noqa: BLE001
                log.exception("engine death listener failed")
        for command in leftover:  # e.g. add_request: run it so the request gets its error below
            try:
                command()
            except Exception:  # noqa: BLE001
                pass
        dead = EngineDeadError("the engine failed and is restarting; retry the request")
        for rid in list(engine.requests):
            try:
                engine.abort(rid, error=dead)
            except Exception:  # noqa: BLE001
                pass
        self.num_running = self.num_waiting = 0


class EngineClient:
    """What protocols use: ``generate()``, ``abort()``, ``encode()`` and model facts."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.info.tokenizer
        self.max_model_len = engine.max_model_len
        self.refusal: LLMServeError | None = None  # set when shutdown aborted everything
        self.loop = EngineLoop(engine)
        self.loop.start()

    @property
    def is_dead(self) -> bool:
        return self.loop.error is not None or not self.loop.is_alive()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def validate(self, prompt_ids: list[int], request: GenerateRequest, param: str = "prompt") -> None:
        """Raise InvalidRequestError (vLLM's wording) for inputs the engine cannot run."""
        vocab = self.info.vocab_size
        if not prompt_ids:
            raise InvalidRequestError("the prompt must not be empty", param=param)
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary (vocab size {vocab})", param=param)
        sp = request.sampling
        for name, ids in (("logit_bias", sp.logit_bias.keys()), ("stop_token_ids", sp.stop_token_ids),
                          ("bad_words_token_ids", [t for seq in sp.bad_words_token_ids for t in seq])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is out of vocabulary (vocab size {vocab})",
                                          param=name)
        m, k = self.max_model_len, len(prompt_ids)
        if k >= m:
            raise InvalidRequestError(
                f"This model's maximum context length is {m} tokens. However, your request has {k} input "
                f"tokens. Please reduce the length of the input.", param=param)
        if sp.max_tokens is not None and sp.max_tokens > m - k:
            raise InvalidRequestError(
                f"'max_tokens' is too large: {sp.max_tokens}. This model's maximum context length is {m} tokens "
                f"and your request has {k} input tokens ({sp.max_tokens} > {m} - {k}).", param="max_tokens")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def prepare(self, request: GenerateRequest, param: str = "prompt") -> list[int]:
        """Tokenize and validate ``request`` in place (idempotent); return its prompt ids.

        Protocols call this before answering, so a bad request fails with a status code
        instead of in the middle of a stream.
        """
        if request.prompt_token_ids is None:
            request.prompt_token_ids = self.encode(request.prompt or "", request.add_special_tokens)
        if request.sampling.bad_words:
            ids = request.sampling.bad_words_token_ids + self._bad_words_ids(request.sampling.bad_words)
            request.sampling = request.sampling.model_copy(update={"bad_words_token_ids": ids, "bad_words": []})
        self.validate(request.prompt_token_ids, request, param)
        return request.prompt_token_ids

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
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                    f"has {len(ids)} input tokens. Please reduce the length of the input.", param=param)
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

        self.loop.submit(lambda: self.engine.add_embed(inputs, done))
        return await fut

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Run ``request``; yield its events until the finished one. Raises kernel errors."""
        if self.info.task == "embed":
            raise InvalidRequestError("this server runs an embedding model (--task embed); it serves "
                                      "/v1/embeddings, /score and /rerank, not generation", param="model")
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        if self.refusal is not None:
            raise self.refusal
        prompt_ids = list(self.prepare(request))
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        scope = current_scope()  # the HTTP request's admission share and deadline, if any
        deadline = scope.deadline if scope is not None else None

        def sink(out: RequestOutput) -> None:
            try:
                aio.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        self.loop.submit(lambda: self.engine.add_request(request, prompt_ids, sink))
        pending_tokens = len(prompt_ids)  # waiting for prefill until the first event arrives
        if scope is not None:
            scope.add_waiting_tokens(pending_tokens)
        done = False
        try:
            while True:
                if deadline is None:
                    out = await queue.get()
                else:
                    try:
                        out = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise RequestTimeoutError("the request took longer than the server's request timeout "
                                                  "and was aborted") from None
                if scope is not None and pending_tokens:
                    scope.remove_waiting_tokens(pending_tokens)
                    pending_tokens = 0
                if out.error is not None:
                    done = True
                    raise out.error
                done = out.finished
                if done:
                    note_output(out)  # token counts and timings for the request log line
                yield out
                if done:
                    return
        finally:
            if scope is not None and pending_tokens:
                scope.remove_waiting_tokens(pending_tokens)
            if not done:
                self.abort(request.request_id)

    async def generate_many(self, requests: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run several requests concurrently; yield ``(request index, event)`` as events arrive.

        Closing the iterator early cancels every request (each stream aborts itself); the first
        error of any request is raised.
        """
        if len(requests) == 1:  # the common case needs no tasks
            async for event in self.generate(requests[0]):
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request: GenerateRequest) -> None:
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

    def abort(self, request_id: str) -> None:
        try:
            self.loop.submit(lambda: self.engine.abort(request_id))
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

    async def check_idle(self) -> bool:
        """Run the engine's idle invariant check on the engine thread (for tests)."""
        aio = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = aio.create_future()

        def check() -> None:
            try:
                result = self.engine.check_idle()
                aio.call_soon_threadsafe(fut.set_result, result)
            except BaseException as exc:  # noqa: BLE001
                aio.call_soon_threadsafe(fut.set_exception, exc)

        self.loop.submit(check)
        return await fut

    def shutdown(self) -> None:
        self.loop.stop()
        self.loop.join(timeout=10)
        self.engine.backend.close()
