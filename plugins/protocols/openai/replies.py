"""What the chat and completions replies share: token texts, the logprob shapes (non-finite
logprobs clamped: JSON has no -Infinity), usage and the system fingerprint."""

from __future__ import annotations

from typing import Any

from llmserve import __version__
from llmserve import TokenLogprob
from llmserve import TokenText, clamp_logprob

# Every reply's ``system_fingerprint``: a string, as OpenAI and TGI send (text_generation's
# Client.chat refuses a reply without one).
SYSTEM_FINGERPRINT = f"llmserve-{__version__}"


class Endpoint:
    """A route handler of the protocol: reaches the tokenizer once the model has loaded."""

    def __init__(self, protocol: Any) -> None:
        self.p = protocol
        self._tt: TokenText | None = None

    @property
    def tt(self) -> "TokenText":
        if self._tt is None:  # the model loads after routes are built
            self._tt = TokenText(self.p.context.engine.tokenizer)
        return self._tt

    def labels(self, body: Any) -> "TokenText | TokenIds":
        """How logprob entries name tokens: their text, or ``token_id:<id>`` when the request
        (else the server's ``return_tokens_as_token_ids``) asks for ids."""
        as_ids = body.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.p.context.config.parsing.return_tokens_as_token_ids
        return TOKEN_IDS if as_ids else self.tt


class TokenIds:
    """Tokens named ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``): unambiguous
    where a token's text is not valid UTF-8 on its own."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"


TOKEN_IDS = TokenIds()


def prompt_logprobs(entries: list[TokenLogprob | None] | None, tt: TokenText, want: int) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``null`` (the first token) or
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt's own token and its
    ``want`` best alternatives."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        best = [t for t, _ in e.top]
        rank = e.rank if e.rank is not None else (best.index(e.token_id) + 1 if e.token_id in best else None)
        item = {str(e.token_id): {"logprob": clamp_logprob(e.logprob), "rank": rank,
                                  "decoded_token": tt.text(e.token_id)}}
        for r, (t, lp) in enumerate(e.top[:want], 1):
            item.setdefault(str(t), {"logprob": clamp_logprob(lp), "rank": r, "decoded_token": tt.text(t)})
        out.append(item)
    return out


def completion_logprobs(items: list[tuple[int, TokenLogprob | None]], tt: "TokenText | TokenIds", offset: int,
                        want_top: int) -> dict:
    """OpenAI completions logprobs over ``(token_id, logprob entry)``; a None entry (the first
    prompt token under echo) gives null logprob and null top_logprobs."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for token_id, e in items:
        text = tt.text(token_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(clamp_logprob(e.logprob))
        # The token itself first, then its best alternatives: vLLM's order, which clients rely on
        # (the first key of each entry is read as the token, as vLLM's own tests do).
        top = {text: clamp_logprob(e.logprob)}
        for t, lp in e.top[:want_top]:
            top.setdefault(tt.text(t), clamp_logprob(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
