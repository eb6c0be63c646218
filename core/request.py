"""The dialect-neutral generate request."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmserve.sampling import SamplingParams


class LogitsMask(Protocol):
    """Restricts the next token of one sequence (guided decoding plugs in here).

    The engine creates one mask per sequence (``GenerateRequest.mask_factory()``), so masks
    may keep per-sequence state. Before each sampled token it calls ``allowed(output_ids)``
    with the tokens generated so far; ``None`` means "no restriction", otherwise only the
    returned token ids may be sampled.
    """

    def allowed(self, output_token_ids: list[int]) -> list[int] | None: ...


@dataclass(slots=True)
class GenerateRequest:
    """One generation request as the engine sees it.

    Give either ``prompt`` (text, tokenized by the engine) or ``prompt_token_ids``.
    ``priority``: 1 is highest, larger numbers wait longer. ``deadline`` is an absolute
    ``time.monotonic()`` (build it with ``deadline_after``) past which the engine client
    ends the request: finish reason "length" if it produced output, else
    ``RequestTimeoutError``; its blocks are freed.
    """

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 5
    deadline: float | None = None
    add_special_tokens: bool = True
    mask_factory: Any = None  # Callable[[], LogitsMask] | None


def deadline_after(seconds: float | None) -> float | None:
    """The ``deadline`` for a time budget of ``seconds`` from now (None: no deadline).

    Every deadline in the server is on this one clock: monotonic, so a wall-clock step
    (NTP, a suspended VM) neither fires nor postpones it.
    """
    return None if seconds is None else time.monotonic() + seconds
