"""TGI token objects: ``{id, text, logprob, special}`` built from the engine's output events."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from llmserve import SequenceDelta, TokenLogprob
from llmserve import IncrementalDetokenizer


def finite(x: float | None) -> float | None:
    """JSON has no NaN/Infinity: TGI serialises an unknown logprob as null."""
    return x if x is not None and math.isfinite(x) else None


def finish_reason(reason: str | None, stop_reason: Any) -> str:
    """Kernel finish_reason/stop_reason -> TGI's ``length`` / ``eos_token`` / ``stop_sequence``."""
    if reason == "stop":
        return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"
    return "length"


class TokenFactory:
    """Per-server helper: token texts (cached) and the special-token set."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        specials = getattr(tokenizer, "all_special_ids", None) or []
        self.special = frozenset(int(i) for i in specials) | frozenset(eos_token_ids)
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token(self, token_id: int, logprob: float | None, text: str | None = None) -> dict:
        return {"id": token_id, "text": self.text(token_id) if text is None else text,
                "logprob": finite(logprob), "special": token_id in self.special}

    def prefill(self, prompt_ids: list[int], logprobs: list[TokenLogprob | None] | None) -> list[dict]:
        """Prompt tokens with their logprobs; the first has none (null), as in TGI."""
        lps = list(logprobs or [])
        out = []
        for i, tid in enumerate(prompt_ids):
            entry = lps[i] if i < len(lps) else None
            out.append({"id": tid, "text": self.text(tid),
                        "logprob": finite(entry.logprob) if entry is not None and i > 0 else None})
        return out

    def top(self, entry: TokenLogprob | None, n: int) -> list[dict]:
        if entry is None or n <= 0:
            return []
        return [self.token(t, lp) for t, lp in entry.top[:n]]


class Sequence:
    """One generated sequence, rebuilt from engine deltas.

    ``text`` is the engine's text (special tokens skipped, the stop string kept). Token texts
    come from a second incremental detokenizer that keeps special tokens (TGI shows
    ``</s>`` with ``special: true``); so the texts of the non-special tokens add up to ``text``.
    """

    def __init__(self, factory: TokenFactory, prompt_ids: list[int], top_n: int) -> None:
        self.factory = factory
        self.top_n = top_n
        self.detok = IncrementalDetokenizer(factory.tokenizer, prompt_ids, skip_special_tokens=False)
        self.text = ""
        self.tokens: list[dict] = []
        self.top_tokens: list[list[dict]] = []
        self.logprob_sum = 0.0
        self.finish_reason: str | None = None

    def feed(self, delta: SequenceDelta) -> list[tuple[dict, list[dict]]]:
        """Add one delta; return its new ``(token, top_tokens)`` pairs."""
        new = []
        entries = delta.logprobs or []
        for i, tid in enumerate(delta.token_ids):
            entry = entries[i] if i < len(entries) else None
            piece = self.detok.add([tid])
            token = self.factory.token(tid, entry.logprob if entry is not None else None, piece)
            top = self.factory.top(entry, self.top_n)
            if token["logprob"] is not None:
                self.logprob_sum += token["logprob"]
            self.tokens.append(token)
            self.top_tokens.append(top)
            new.append((token, top))
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish_reason = finish_reason(delta.finish_reason, delta.stop_reason)
            tail = self.detok.flush()
            if tail and self.tokens:
                self.tokens[-1]["text"] += tail
        return new

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / len(self.tokens) if self.tokens else -math.inf
