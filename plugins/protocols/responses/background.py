"""Background responses: ``background: true`` answers at once with a ``queued`` response while
the generation runs on; ``GET /v1/responses/{id}`` polls it (the store holds its latest state),
``GET ...?stream=true&starting_after=N`` replays its events after ``N`` and follows the rest, and
``POST /v1/responses/{id}/cancel`` stops it (status ``cancelled``).

A background response needs the response store (it is read back by id). Its run holds a lease on
its model, so the model is not unloaded under it; it ends with the server. The events of the
latest runs are kept for replay, a bounded number of runs (the oldest finished ones go first).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, AsyncIterator

from llmserve import InvalidRequestError
from llmserve import sse


async def frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Events as SSE frames (``event: <type>``)."""
    async for event in events:
        yield sse(event, event=event["type"])

#: Runs whose events are kept for ``GET ?stream=true`` (finished ones are dropped first).
MAX_RUNS = 256


class Run:
    """One background response: its task and its events so far."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.done = False
        self.task: asyncio.Task[None] | None = None

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.changed.set()

    async def follow(self, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events numbered above ``after``, then each new one until the run ends."""
        index = 0
        while True:
            while index < len(self.events):
                event = self.events[index]
                index += 1
                if event["sequence_number"] > after:
                    yield event
            if self.done:
                return
            self.changed.clear()
            await self.changed.wait()


class Background:
    """The background runs of one ``ResponsesProtocol``."""

    def __init__(self, protocol: Any, create: Any) -> None:
        self.p, self.create = protocol, create
        self.runs: OrderedDict[str, Run] = OrderedDict()

    def start(self, prep: Any) -> dict[str, Any]:
        """Store the queued response, start its run, and return the queued response."""
        store = self.p.store
        if store is None:
            raise InvalidRequestError("background: a background response is read back by id, which needs the "
                                      "response store (responses: store: true in the server's config)",
                                      param="background")
        if prep.body.store is False:
            raise InvalidRequestError("background: a background response must be stored (store: false was sent)",
                                      param="background")
        queued = self.create.snapshot(prep, "queued", [])
        store.put(prep.owner, queued, [*prep.history, *prep.input_items])
        run = Run(prep.owner)
        self._keep(prep.id, run)
        context = self.p.context
        slot = context.slot
        context.pool.lease(slot)  # released when the run ends: its model stays loaded meanwhile

        async def drive() -> None:
            try:
                async for event in self.create.events(prep):
                    if event["type"] == "response.in_progress":
                        store.put(prep.owner, event["response"], [*prep.history, *prep.input_items])
                    run.add(event)
            except asyncio.CancelledError:
                self._cancelled(prep, run)
            finally:
                run.done = True
                run.changed.set()
                context.pool.release(slot)

        run.task = asyncio.get_running_loop().create_task(drive())
        return queued

    def _keep(self, response_id: str, run: Run) -> None:
        self.runs[response_id] = run
        while len(self.runs) > MAX_RUNS:
            finished = next((k for k, r in self.runs.items() if r.done), None)
            if finished is None:
                break
            del self.runs[finished]

    def _cancelled(self, prep: Any, run: Run) -> None:
        store = self.p.store
        entry = store.get(prep.owner, prep.id)
        response = {**(entry.response if entry is not None else self.create.snapshot(prep, "queued", [])),
                    "status": "cancelled"}
        store.put(prep.owner, response, entry.conversation if entry is not None else [])
        run.add({"type": "response.cancelled", "response": response,
                 "sequence_number": run.events[-1]["sequence_number"] + 1 if run.events else 0})

    def run_of(self, owner: str, response_id: str) -> Run:
        run = self.runs.get(response_id)
        if run is None or run.owner != owner:
            raise InvalidRequestError("stream: only a background response's events can be streamed again",
                                      param="stream")
        return run

    async def cancel(self, owner: str, response_id: str, stored: dict[str, Any]) -> dict[str, Any]:
        """Stop a background response (a finished one is returned as it is)."""
        run = self.runs.get(response_id)
        if not stored.get("background") or run is None or run.owner != owner:
            raise InvalidRequestError("Cannot cancel a synchronous response.", param="response_id")
        if run.task is not None and not run.done:
            run.task.cancel()
            await asyncio.wait([run.task])
        entry = self.p.store.get(owner, response_id)
        return entry.response if entry is not None else stored
