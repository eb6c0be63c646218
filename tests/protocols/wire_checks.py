"""Checks the dialect shape tests share: SSE bodies without a ``[DONE]`` terminator, JSON error
bodies, and an engine whose stream breaks after its first event."""

from __future__ import annotations

import json
from typing import Any, Iterable

from llmserve.errors import GenerationError


def sse_data(text: str) -> list[dict]:
    """The JSON events of an SSE body made only of ``data:`` events, none of them ``[DONE]``."""
    chunks = [c for c in text.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), chunks
    assert all(c[6:] != "[DONE]" for c in chunks)
    return [json.loads(c[6:]) for c in chunks]


def json_error(r: Any, status: int, keys: set[str], needles: Iterable[str]) -> dict:
    """The body of an error answer: ``status``, JSON, exactly ``keys``, a text ``error`` holding
    every needle."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == keys and isinstance(body["error"], str), body
    for needle in needles:
        assert needle in body["error"], body
    return body


def break_after_first_event(monkeypatch: Any, engine: Any, message: str) -> None:
    """Make ``engine.generate`` yield its first event, then raise ``GenerationError(message)``
    (undone when the test ends)."""
    real = engine.generate

    async def failing(request: Any) -> Any:
        async for event in real(request):
            yield event
            raise GenerationError(message)

    monkeypatch.setattr(engine, "generate", failing)
