"""The logprob entries the OpenAI-style dialects reply with: a token's text (decoded once, then
cached), chat-style entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``) as Chat
Completions and the Responses API share them, and non-finite logprobs clamped (JSON has no
-Infinity)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from llmserve.outputs import TokenLogprob


def clamp_logprob(x: float) -> float:
    """``x``, or -9999.0 for a logprob JSON cannot carry (-inf, nan)."""
    return -9999.0 if not math.isfinite(x) else x


class TokenLabels(Protocol):
    """How logprob entries name a token: its text, or another label (``token_id:<id>``)."""

    def text(self, token_id: int) -> str: ...


class TokenText:
    """Token id -> its text, cached (logprob entries need it per token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: "list[TokenLogprob]", labels: TokenLabels) -> list[dict[str, Any]]:
    """Chat-style logprob entries of ``entries`` (each with its alternatives), tokens named by
    ``labels``."""
    out = []
    for e in entries:
        tok = labels.text(e.token_id)
        out.append({"token": tok, "logprob": clamp_logprob(e.logprob), "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [{"token": labels.text(t), "logprob": clamp_logprob(lp),
                                      "bytes": list(labels.text(t).encode("utf-8"))} for t, lp in e.top]})
    return out
