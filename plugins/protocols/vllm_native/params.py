"""vLLM-native fields -> the kernel's SamplingParams: the MindIE spec's ranges in vLLM's
wording, then the kernel's own checks."""

from __future__ import annotations

from llmserve import InvalidRequestError
from llmserve import GuidedSpec, only_one
from llmserve import SamplingParams

from .guided import legacy_specs, structured_outputs_spec, with_backend
from .wire import VLLMGenerateRequest

MAX_STOP_CHARS = 32 * 1024           # MindIE: total characters of all stop strings
INT32 = (-(2**31), 2**31 - 1)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def sampling_params(body: VLLMGenerateRequest, default_max_tokens: int | None) -> SamplingParams:
    """The spec's ranges, in vLLM's wording, then the kernel's own checks."""
    n = 1 if body.n is None else body.n
    _check(n >= 1, f"n must be at least 1, got {n}.", "n")
    if body.best_of is not None:
        _check(body.best_of >= n, f"best_of must be greater than or equal to n, got n={n} and best_of={body.best_of}.",
               "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}.", name)
    if body.repetition_penalty is not None:
        _check(0.0 < body.repetition_penalty <= 2.0,
               f"repetition_penalty must be in (0, 2], got {body.repetition_penalty}.", "repetition_penalty")
    if body.temperature is not None:
        _check(body.temperature >= 0.0, f"temperature must be non-negative, got {body.temperature}.", "temperature")
    if body.top_p is not None:
        _check(0.0 < body.top_p <= 1.0, f"top_p must be in (0, 1], got {body.top_p}.", "top_p")
    if body.top_k is not None:
        _check(body.top_k == -1 or body.top_k >= 1, f"top_k must be -1 (disable), or at least 1, got {body.top_k}.",
               "top_k")
    if body.min_p is not None:
        _check(0.0 <= body.min_p <= 1.0, f"min_p must be in [0, 1], got {body.min_p}.", "min_p")
    if body.max_tokens is not None:
        _check(body.max_tokens >= 1, f"max_tokens must be at least 1, got {body.max_tokens}.", "max_tokens")
    if body.min_tokens is not None:
        _check(body.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.",
               "min_tokens")
    if body.seed is not None:
        _check(0 <= body.seed <= 2**64 - 1, f"seed must be in [0, {2**64 - 1}], got {body.seed}.", "seed")
    if body.use_beam_search:
        raise InvalidRequestError("use_beam_search is not supported by this server (send false or leave it out)",
                                  param="use_beam_search")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _check(all(stop), "stop strings must be at least 1 character long.", "stop")
    total = sum(len(s) for s in stop)
    _check(total <= MAX_STOP_CHARS,
           f"the stop strings must be at most {MAX_STOP_CHARS} characters in all, got {total}.", "stop")
    stop_ids = [t for t in body.stop_token_ids or [] if INT32[0] <= t <= INT32[1]]  # MindIE ignores the others
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
    if max_tokens is not None and body.min_tokens is not None:
        _check(body.min_tokens <= max_tokens,
               f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}.",
               "min_tokens")
    return SamplingParams.build(
        n=n, best_of=body.best_of, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stop, stop_token_ids=stop_ids,
        bad_words=body.bad_words, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, max_tokens=max_tokens)



def guided_spec(body: VLLMGenerateRequest) -> GuidedSpec | None:
    """The output constraint: ``structured_outputs`` (or its older name ``guided_decoding``) or a
    legacy ``guided_*`` field; two at once are a 400 naming both."""
    given = {"structured_outputs": structured_outputs_spec(body.structured_outputs),
             "guided_decoding": structured_outputs_spec(body.guided_decoding, "guided_decoding"), **legacy_specs(body)}
    return with_backend(only_one(given), body)
