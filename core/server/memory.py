"""Giving memory back to the system after bursts of large requests.

glibc's allocator keeps the heap that parsing a large body, tokenizing a long prompt or
rendering a big template grew: freed, but still counted in the process's RSS, so a server that
once answered a few large requests looks (to a container's memory limit, or to an operator)
as if it still needed that memory. ``trim_when_idle`` asks glibc to return free pages
(``malloc_trim(0)``, every arena) once the server has been idle for a while after serving
something, never while requests are open. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from llmserve.server.context import ServerContext

log = logging.getLogger("llmserve.server")


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` (returns 1 when memory was released), or None without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


async def trim_when_idle(context: "ServerContext", interval: float) -> None:
    """Every ``interval`` seconds: if requests were served since the last look and none is open
    now, return the allocator's free pages to the system (on a worker thread: on a large
    fragmented heap it can take some milliseconds)."""
    trim = heap_trimmer()
    if trim is None or interval <= 0:
        return
    admission = context.admission
    seen = admission.opened
    while True:
        await asyncio.sleep(interval)
        if admission.opened == seen or admission.requests:
            continue  # nothing new, or requests still open: look again later
        seen = admission.opened
        await asyncio.to_thread(trim)
