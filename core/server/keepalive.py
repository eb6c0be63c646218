"""SSE keep-alive: a comment line (``: ping``) whenever a stream has been silent too long.

Proxies and load balancers cut connections that carry no bytes for a while (often 60 s);
a long prefill, or a wait in the queue, can be that long. SSE clients ignore comment lines,
so a ping keeps the connection alive without changing what the client reads. Only SSE
bodies get pings: other streaming formats (vLLM-native's ``\\0`` records) have no comments.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

PING = ": ping\n\n"


async def with_pings(source: AsyncIterator[Any], interval: float, ping: str = PING) -> AsyncIterator[Any]:
    """Yield ``source``'s items, plus ``ping`` after every ``interval`` seconds without one.

    The next item is awaited in a helper task so that waiting can time out without
    cancelling the source; closing this iterator cancels that task (which aborts the engine
    request behind the source) and closes the source.
    """
    if interval <= 0:
        async for item in source:
            yield item
        return
    it = source.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield ping
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except BaseException:  # noqa: BLE001 - the source's own ending, already handled there
                pass
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
