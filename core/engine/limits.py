"""Per-request work bounds checked before any costly step: prompt size before tokenization,
stop strings before the engine builds a matcher per sequence.

Every dialect reaches the engine through ``EngineClient.prepare`` / ``encode``, so a bound
kept here covers every dialect (a third-party one included) without each repeating it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.config import LimitsConfig
from llmserve.errors import ContextLengthError, InvalidRequestError
from llmserve.request import REJECT, RequestPolicy
from llmserve.sampling import MAX_LOGPROBS, SamplingParams

# Characters per token assumed when the prompt cap is derived from the context length: far
# above what real text averages (about 4), so a prompt refused by it would have been refused
# for its token count anyway, only after seconds of tokenizing instead of at once.
CHARS_PER_TOKEN = 32
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_CHARS = 32 * 1024


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds of one server (``--max-prompt-chars``, ``--max-stop-strings``, ``--max-stop-chars``)."""

    max_prompt_chars: int
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_model_len: int = 0
    max_logprobs: int = MAX_LOGPROBS
    token_span: int | None = None  # the most characters one token covers (``text/token_floor.py``)
    strict_max_tokens: bool = False  # ``fit`` policies refuse a max_tokens over the room (--strict-max-tokens)

    @classmethod
    def from_config(cls, limits: LimitsConfig, max_model_len: int, token_span: int | None = None) -> "RequestLimits":
        """The bounds the limits section sets for a model of ``max_model_len`` tokens whose
        tokens cover at most ``token_span`` characters each (None: no such bound is known)."""
        prompt = limits.max_prompt_chars
        return cls(max_prompt_chars=prompt if prompt is not None else CHARS_PER_TOKEN * max_model_len,
                   max_stop_strings=limits.max_stop_strings, max_stop_chars=limits.max_stop_chars,
                   max_model_len=max_model_len, max_logprobs=limits.max_logprobs, token_span=token_span,
                   strict_max_tokens=limits.strict_max_tokens)

    def check_fits(self, text: str | None, param: str = "prompt") -> None:
        """Refuse (400) a prompt text that needs more tokens than the context holds whatever its
        tokenization: ``len(text) / token_span`` tokens at least. Only for a prompt that must fit
        whole (not one the request truncates); cheap, so it runs before tokenizing."""
        span = self.token_span
        if text is None or not span or not self.max_model_len or len(text) < span * self.max_model_len:
            return
        least = -(-len(text) // span)
        raise ContextLengthError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your request has at "
            f"least {least} input tokens ({len(text)} characters, and a token of this model covers at most "
            f"{span}). Please reduce the length of the input.", tokens=least, limit=self.max_model_len, param=param)

    def check_prompt(self, text: str | None, param: str = "prompt") -> None:
        """Refuse a prompt text too long to tokenize (400), before any tokenizing."""
        if text is not None:
            self.check_prompt_size(len(text), param)

    def check_prompt_size(self, chars: int, param: str = "prompt") -> None:
        """The same for a prompt of ``chars`` characters in all (messages before rendering)."""
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{chars} characters of input, more than the {self.max_prompt_chars} this server tokenizes "
                f"(--max-prompt-chars). Please reduce the length of the input.", param=param)

    def check_logprobs(self, sampling: SamplingParams, policy: RequestPolicy = REJECT) -> None:
        """Refuse more log probabilities per token than ``--max-logprobs`` allows (400)."""
        for field, asked in (("logprobs", sampling.logprobs), ("prompt_logprobs", sampling.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                name = policy.name(field)
                raise InvalidRequestError(f"{name}: at most {self.max_logprobs} log probabilities per token are "
                                          f"allowed on this server (--max-logprobs), got {asked}", param=name)

    def check_stops(self, sampling: SamplingParams, param: str = "stop") -> None:
        """Refuse more stop strings, or more stop-string characters, than the server allows (400)."""
        stop = sampling.stop
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(f"at most {self.max_stop_strings} stop strings are allowed, got {len(stop)} "
                                      f"(--max-stop-strings)", param=param)
        total = sum(len(s) for s in stop)
        if total > self.max_stop_chars:
            raise InvalidRequestError(f"the stop strings may have at most {self.max_stop_chars} characters in all, "
                                      f"got {total} (--max-stop-chars)", param=param)
