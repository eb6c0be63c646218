"""Sharing the interpreter lock with the engine thread while other threads run Python.

Compiling an output constraint or rendering a chat template is pure Python on a thread of its
own. Beside such a thread, the engine thread, which lets the lock go around each native call,
waits up to the interpreter's switch interval (5 ms) to get it back, at every call: a decode
step of a few hundred calls then takes seconds. ``quick_handoff`` shortens the interval while
such work runs.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

# Seconds. Measured: a torch loop ran 9x slower beside a busy Python thread at 5 ms, as fast as
# alone at 20 µs.
HANDOFF = 0.00005

_lock = threading.Lock()
_users = 0
_normal = 0.0  # the interval before the first user came


@contextmanager
def quick_handoff() -> Iterator[None]:
    """While the block runs, a thread waiting for the interpreter lock gets it after 50 µs. Counted:
    blocks on several threads overlap, and the interval comes back when the last one ends."""
    global _users, _normal
    with _lock:
        if _users == 0:
            _normal = sys.getswitchinterval()
            sys.setswitchinterval(min(_normal, HANDOFF))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_normal)
