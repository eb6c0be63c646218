"""Preparing a request for the engine, once and in one place: the bounds that hold before any
tokenizing, tokenizing, the server's sampling defaults, the room the prompt leaves under the
dialect's length policy, and validation (vLLM's wording), into a frozen ``PreparedRequest``.

Errors name fields as the client sent them (``RequestPolicy.name``); nothing here mutates the
caller's ``GenerateRequest``. It blocks while it tokenizes: the engine client runs it in a
tokenizer thread when there is text to tokenize (``EngineClient.aprepare``).
"""

from __future__ import annotations

from typing import Any, Callable

from llmserve.engine.defaults import SamplingDefaults
from llmserve.engine.limits import RequestLimits
from llmserve.errors import ContextLengthError, InvalidRequestError
from llmserve.media.inputs import check_placeholders
from llmserve.request import REJECT, GenerateRequest, PreparedRequest, RequestPolicy
from llmserve.sampling import SamplingParams


class Preparer:
    """Turns ``GenerateRequest``s into ``PreparedRequest``s for one served model."""

    def __init__(self, tokenize: Callable[[str, bool], list[int]], vocab_size: int, max_model_len: int,
                 limits: RequestLimits, defaults: SamplingDefaults, media: Any = None) -> None:
        self.tokenize = tokenize
        self.media = media  # the model's MediaProcessor, when it takes images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits
        self.defaults = defaults

    def check_limits(self, request: GenerateRequest, policy: RequestPolicy = REJECT) -> None:
        """The bounds that hold before any tokenizing: prompt characters (and a prompt too long
        for the context whatever its tokens), stop strings and log probabilities (400). Cheap:
        lengths only, so the event loop may run it."""
        if request.prompt_token_ids is None:
            self.limits.check_prompt(request.prompt, policy.prompt)
            self.limits.check_fits(request.prompt, policy.prompt)
        self.limits.check_stops(request.sampling, policy.name("stop"))
        self.limits.check_logprobs(request.sampling, policy)

    def prepare(self, request: GenerateRequest, policy: RequestPolicy = REJECT) -> PreparedRequest:
        """Check, tokenize, fit and validate ``request`` under ``policy``; raise the core's
        errors (400s naming the client's fields)."""
        self.check_limits(request, policy)
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.media:
            raise ValueError("a request with images gives its prompt as token ids (the images' expansion)")
        else:
            ids = self.tokenize(request.prompt or "", request.add_special_tokens)
        limit = self._limit(len(ids), policy)
        room = limit - len(ids)
        sampling = self.defaults.apply(request.sampling, len(ids), limit)
        if sampling.bad_words:
            bad = sampling.bad_words_token_ids + self._bad_words_ids(sampling.bad_words)
            sampling = sampling.model_copy(update={"bad_words_token_ids": bad, "bad_words": []})
        self.validate(ids, sampling, policy)
        if self.media is not None:
            check_placeholders(ids, request.media, self.media.placeholder_id, policy.prompt)
        capped = False
        asked = sampling.max_tokens
        if asked is None or asked > room:
            if asked is not None and self._rejects(policy):
                raise InvalidRequestError(
                    f"'{policy.name('max_tokens')}' is too large: {asked}. This model's maximum context length is "
                    f"{limit} tokens and your request has {len(ids)} input tokens ({asked} > {limit} - {len(ids)}).",
                    param=policy.name("max_tokens"))
            capped = asked is not None
            sampling = sampling.model_copy(update={"max_tokens": room})
        return PreparedRequest(request_id=request.request_id, prompt=request.prompt, prompt_token_ids=tuple(ids),
                               sampling=sampling, priority=request.priority, deadline=request.deadline,
                               mask_factory=request.mask_factory, capped=capped,
                               reasoning_budget=request.reasoning_budget, media=request.media)

    def _rejects(self, policy: RequestPolicy) -> bool:
        """Whether ``policy`` refuses a ``max_tokens`` over the room (``fit``: the server decides)."""
        return policy.length == "reject" or (policy.length == "fit" and self.limits.strict_max_tokens)

    def _limit(self, prompt_tokens: int, policy: RequestPolicy) -> int:
        """The context length this request runs under: the dialect's own (at most the server's),
        else the server's; a prompt that leaves no room is refused here."""
        m = self.max_model_len
        if policy.context_limit is not None:
            limit = min(policy.context_limit, m)
            if prompt_tokens >= limit:
                raise ContextLengthError(
                    f"the prompt has {prompt_tokens} tokens, which does not fit the context length of {limit} "
                    f"tokens ({policy.limit_param}, at most the server's {m})", tokens=prompt_tokens, limit=limit,
                    param=policy.limit_param)
            return limit
        if prompt_tokens >= m:
            raise ContextLengthError(
                f"This model's maximum context length is {m} tokens. However, your request has {prompt_tokens} "
                f"input tokens. Please reduce the length of the input.", tokens=prompt_tokens, limit=m,
                param=policy.prompt)
        return m

    def validate(self, prompt_ids: list[int], sampling: SamplingParams, policy: RequestPolicy = REJECT) -> None:
        """Raise InvalidRequestError (vLLM's wording) for token ids the model does not have."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise InvalidRequestError("the prompt must not be empty", param=policy.prompt)
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary (vocab size {vocab})",
                                      param=policy.prompt)
        fields: tuple[tuple[str, Any], ...] = (
            ("logit_bias", sampling.logit_bias.keys()), ("stop_token_ids", sampling.stop_token_ids),
            ("bad_words_token_ids", [t for seq in sampling.bad_words_token_ids for t in seq]),
            ("allowed_token_ids", sampling.allowed_token_ids or ()),
            ("logprob_token_ids", sampling.logprob_token_ids or ()))
        for field, ids in fields:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                name = policy.name(field)
                raise InvalidRequestError(f"{name}: token id {bad} is out of vocabulary (vocab size {vocab})",
                                          param=name)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenize(variant, False)
                if ids and ids not in out:
                    out.append(ids)
        return out
