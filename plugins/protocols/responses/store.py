"""The opt-in response store: bounded, in memory, one budget per API key.

A stored entry is the response object and the conversation that led to it (every input
item of the chain so far plus the response's output items), so ``previous_response_id``
continues even after the responses before it were dropped. Each owner (the API key the
request presented, hashed; one shared owner when the server has no keys) has its own least
recently used list, bounded by count and by bytes of JSON: one client filling the store
drops only its own oldest responses, and reads or deletes only its own.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Entry:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int


class ResponseStore:
    """``put`` / ``get`` / ``delete`` by owner and response id, least recently used dropped first."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._owners: dict[str, OrderedDict[str, Entry]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def owner(api_key: str | None) -> str:
        """The owner of a request's responses: a hash of its key, never the key itself."""
        return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest() if api_key else ""

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response``; False when it alone is over the byte bound (then nothing is kept)."""
        size = len(json.dumps([response, conversation]))  # ASCII-escaped: an upper bound on UTF-8 bytes
        if size > self.max_bytes:
            return False
        with self._lock:
            entries = self._owners.setdefault(owner, OrderedDict())
            old = entries.pop(response["id"], None)
            total = self._bytes.get(owner, 0) - (old.size if old else 0)
            while entries and (len(entries) >= self.max_responses or total + size > self.max_bytes):
                _, dropped = entries.popitem(last=False)
                total -= dropped.size
            entries[response["id"]] = Entry(response, conversation, size)
            self._bytes[owner] = total + size
        return True

    def get(self, owner: str, response_id: str) -> Entry | None:
        with self._lock:
            entries = self._owners.get(owner)
            entry = entries.get(response_id) if entries else None
            if entry is not None and entries is not None:
                entries.move_to_end(response_id)
            return entry

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            entries = self._owners.get(owner)
            entry = entries.pop(response_id, None) if entries else None
            if entry is None:
                return False
            self._bytes[owner] -= entry.size
            return True

    def usage(self, owner: str) -> tuple[int, int]:
        """``(responses, bytes)`` kept for ``owner``."""
        with self._lock:
            return len(self._owners.get(owner) or ()), self._bytes.get(owner, 0)
