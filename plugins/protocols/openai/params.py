"""Translate OpenAI request fields into the core's SamplingParams and GenerateRequests."""

from __future__ import annotations

import time
import uuid
from typing import Any, Mapping

from llmserve import InvalidRequestError
from llmserve import GuidedSpec, only_one
from llmserve import GenerateRequest, RequestPolicy
from llmserve import MAX_LOGPROBS, SamplingParams

from ..vllm_native.guided import legacy_specs, structured_outputs_spec, with_backend
from .wire import ChatCompletionRequest, CompletionRequest, SamplingFields

def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
    return out


def _prompt_logprobs(value: int | None, vocab_size: int, cap: int) -> int | None:
    """vLLM's reading of ``prompt_logprobs``: -1 asks for the whole vocabulary, and any count
    over the server's cap is refused with vLLM's message."""
    if value is None:
        return None
    wanted = vocab_size if value == -1 else value
    if wanted > cap:
        raise InvalidRequestError(f"Requested prompt logprobs of {wanted}, which is greater than max allowed: {cap}",
                                  param="prompt_logprobs")
    return wanted


def _unsupported(body: SamplingFields) -> None:
    if body.use_beam_search:
        raise InvalidRequestError("use_beam_search: beam search is not supported by this server (use n or best_of "
                                  "to get several candidates)", param="use_beam_search")


def _logprob_token_ids(body: SamplingFields, logprobs_on: bool) -> list[int] | None:
    ids = body.logprob_token_ids
    if ids is None:
        return None
    if not ids:
        raise InvalidRequestError("`logprob_token_ids` must not be an empty list.", param="logprob_token_ids")
    if not logprobs_on:
        raise InvalidRequestError("when using `logprob_token_ids`, `logprobs` must be set.",
                                  param="logprob_token_ids")
    if len(ids) > MAX_LOGPROBS:
        raise InvalidRequestError(f"`logprob_token_ids` may name at most {MAX_LOGPROBS} tokens, got {len(ids)}",
                                  param="logprob_token_ids")
    return list(ids)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, names: Mapping[str, str] | None = None) -> SamplingParams:
    _unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    mode = "processed" if (body.temp_scaled_logprobs or body.top_p_normalized_logprobs) else None
    chosen = _logprob_token_ids(body, logprobs is not None)
    if chosen is not None:
        logprobs = len(chosen)  # the named tokens take the place of the best alternatives
    return SamplingParams.build(
        names, n=body.n, best_of=body.best_of, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, typical_p=body.typical_p, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias), seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids,
        include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, max_tokens=max_tokens, bad_words=body.bad_words,
        bad_words_token_ids=body.bad_words_token_ids, skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, logprobs_mode=mode, allowed_token_ids=body.allowed_token_ids,
        logprob_token_ids=chosen, speculative=body.speculative)


def completion_sampling(body: CompletionRequest, vocab_size: int, cap: int = MAX_LOGPROBS) -> SamplingParams:
    if body.suffix is not None:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    prompt_lp = _prompt_logprobs(body.prompt_logprobs, vocab_size, cap)
    if body.echo and body.logprobs is not None:
        prompt_lp = body.logprobs if prompt_lp is None else max(prompt_lp, body.logprobs)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and body.echo:
        raise InvalidRequestError("max_tokens: must be at least 1", param="max_tokens")
    return sampling_params(body, max_tokens, body.logprobs, prompt_lp)


def chat_policy(body: ChatCompletionRequest) -> RequestPolicy:
    """How a chat request is prepared: errors name ``messages`` and the fields this request sent
    (``top_logprobs``; ``max_completion_tokens`` when given, else ``max_tokens``); an output
    longer than the room is cut to it, as OpenAI's API does (refused, as vLLM does, under
    ``--strict-max-tokens``: the ``fit`` policy)."""
    names = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return RequestPolicy(prompt="messages", names=names, length="fit")


def chat_sampling(body: ChatCompletionRequest, vocab_size: int, cap: int = MAX_LOGPROBS,
                  names: Mapping[str, str] | None = None) -> SamplingParams:
    top = None
    if body.logprobs:
        top = body.top_logprobs or 0
    elif body.top_logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt_lp = _prompt_logprobs(body.prompt_logprobs, vocab_size, cap)
    return sampling_params(body, max_tokens, top, prompt_lp, names)


def truncation(body: Any, max_model_len: int) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens`` keeps (-1: the context length), or None."""
    keep = getattr(body, "truncate_prompt_tokens", None)
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep > max_model_len:
        raise InvalidRequestError("truncate_prompt_tokens value is greater than max_model_len. Please, select a "
                                  "smaller truncation size.", param="truncate_prompt_tokens")
    return keep


def truncate(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """``ids`` cut to ``keep`` tokens: by default (``left``) the first ones go, as in vLLM."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def guided_spec(body: SamplingFields) -> GuidedSpec | None:
    """The request's output constraint: one of ``guided_*``, ``structured_outputs`` and a JSON
    ``response_format`` (two at once are a 400 naming both); ``guided_decoding_backend`` picks
    the decoder."""
    if body.structural_tag is not None:
        raise InvalidRequestError("structural_tag: not supported by this server", param="structural_tag")
    if body.guided_whitespace_pattern is not None:
        raise InvalidRequestError("guided_whitespace_pattern: not supported by this server (JSON is written "
                                  "compactly)", param="guided_whitespace_pattern")
    given = legacy_specs(body)
    given["structured_outputs"] = structured_outputs_spec(body.structured_outputs)
    given["response_format"] = _response_format_spec(getattr(body, "response_format", None))
    return with_backend(only_one(given), body)


def _response_format_spec(fmt: Any) -> GuidedSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GuidedSpec("json_object", None, param="response_format")
    schema = (fmt.json_schema or {}).get("schema")
    if schema is None:
        raise InvalidRequestError("response_format: json_schema.schema is required when type is json_schema",
                                  param="response_format")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format: json_schema.schema must be a JSON object",
                                  param="response_format")
    return GuidedSpec("json_schema", schema, param="response_format")


async def guided_mask(context: Any, body: SamplingFields) -> Any:
    """``GenerateRequest.mask_factory`` for the request, or None. Compiling runs bounded, on the
    compile worker (``GuidedDecoding.compile_async``)."""
    spec = guided_spec(body)
    if spec is None:
        return None
    return await context.guided.compile_async(spec)


def new_request(body: SamplingFields, sampling: SamplingParams, prompt: str | None = None,
                prompt_ids: list[int] | None = None, header_id: str | None = None,
                add_special_tokens: bool = True, suffix: str = "", mask_factory: Any = None) -> GenerateRequest:
    rid = (body.request_id or header_id or uuid.uuid4().hex) + suffix
    # Lower values are scheduled first (1 is the highest of the dialects' 1..5 scale).
    priority = 5 if body.priority is None else body.priority
    return GenerateRequest(prompt=prompt, prompt_token_ids=prompt_ids, sampling=sampling, request_id=rid,
                           priority=priority, add_special_tokens=add_special_tokens, mask_factory=mask_factory)


def now() -> int:
    return int(time.time())
