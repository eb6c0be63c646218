"""One preparation per request (``core/engine/prepare.py``): the room the prompt leaves is computed
once under the dialect's length policy, errors name the client's fields through the policy's
names, and the result is frozen."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from llmserve.engine.defaults import SamplingDefaults
from llmserve.engine.limits import RequestLimits
from llmserve.engine.prepare import Preparer
from llmserve.errors import InvalidRequestError
from llmserve.request import GenerateRequest, RequestPolicy
from llmserve.sampling import SamplingParams

VOCAB, CONTEXT = 100, 32
CHAT = RequestPolicy(prompt="messages", names={"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"})
CAP = RequestPolicy(prompt="inputs", names={"max_tokens": "max_new_tokens"}, length="cap")


def preparer(defaults: SamplingDefaults | None = None) -> Preparer:
    def tokenize(text: str, special: bool) -> list[int]:  # one token per character
        return [ord(c) % VOCAB for c in text]

    limits = RequestLimits(max_prompt_chars=1000, max_model_len=CONTEXT, max_logprobs=5)
    return Preparer(tokenize, VOCAB, CONTEXT, limits, defaults or SamplingDefaults())


def request(prompt: str = "abcd", **sampling: object) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, sampling=SamplingParams.build(**sampling))


def test_reject_names_the_clients_field_and_states_the_room():
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(request(max_tokens=29), CHAT)
    assert err.value.param == "max_completion_tokens"
    assert err.value.message.startswith("'max_completion_tokens' is too large: 29.")
    assert "(29 > 32 - 4)" in err.value.message
    assert preparer().prepare(request(max_tokens=28), CHAT).sampling.max_tokens == 28  # exactly the room


def test_cap_cuts_to_the_room_and_says_so():
    prep = preparer()
    capped = prep.prepare(request(max_tokens=1000), CAP)
    assert capped.sampling.max_tokens == 28 and capped.capped
    unset = prep.prepare(request(), CAP)
    assert unset.sampling.max_tokens == 28 and not unset.capped  # nothing was asked, nothing was cut
    within = prep.prepare(request(max_tokens=5), CAP)
    assert within.sampling.max_tokens == 5 and not within.capped


def test_a_request_without_max_tokens_gets_the_room_under_either_policy():
    assert preparer().prepare(request()).sampling.max_tokens == 28


def test_the_dialects_own_context_limit_is_named_when_the_prompt_does_not_fit():
    policy = dataclasses.replace(CAP, context_limit=8, limit_param="options.num_ctx")
    assert preparer().prepare(request("abc", max_tokens=100), policy).sampling.max_tokens == 5
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(request("abcdefgh"), policy)
    assert err.value.param == "options.num_ctx" and "context length of 8 tokens" in err.value.message
    bigger = dataclasses.replace(policy, context_limit=1000)  # never beyond the server's
    assert preparer().prepare(request("abc"), bigger).sampling.max_tokens == CONTEXT - 3


def test_a_prompt_that_fills_the_context_names_the_prompt_field():
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(request("x" * CONTEXT), CAP)
    assert err.value.param == "inputs" and "maximum context length is 32 tokens" in err.value.message


def test_limit_and_vocabulary_errors_use_the_policys_names():
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(request(logprobs=6), CHAT)
    assert err.value.param == "top_logprobs" and err.value.message.startswith("top_logprobs: at most 5")
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(request(stop_token_ids=[500]), RequestPolicy(names={"stop_token_ids": "eos_ids"}))
    assert err.value.param == "eos_ids" and "out of vocabulary" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        preparer().prepare(GenerateRequest(prompt_token_ids=[]), CAP)
    assert err.value.param == "inputs"


def test_sampling_errors_name_the_clients_fields():
    names = {"max_tokens": "num_predict", "min_tokens": "min_length", "temperature": "options.temperature"}
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.build(names, temperature=-1)
    assert err.value.param == "options.temperature" and err.value.message.startswith("options.temperature: ")
    with pytest.raises(InvalidRequestError) as err:  # a cross-field rule names both fields as sent
        SamplingParams.build(names, min_tokens=5, max_tokens=2)
    assert err.value.param == "min_length" and err.value.message == "min_length (5) must be <= num_predict (2)"
    with pytest.raises(InvalidRequestError) as err:  # without names, the core's own
        SamplingParams.build(min_tokens=5, max_tokens=2)
    assert err.value.param == "min_tokens" and err.value.message == "min_tokens (5) must be <= max_tokens (2)"


def test_preparation_leaves_the_request_alone_and_its_result_is_frozen():
    original = request(bad_words=["ab"])
    prepared = preparer(SamplingDefaults(seed=3)).prepare(original)
    assert original.prompt_token_ids is None and original.sampling.max_tokens is None
    assert original.sampling.bad_words == ["ab"] and original.sampling.seed is None
    assert prepared.prompt_token_ids == (97, 98, 99, 0) and prepared.sampling.seed is not None
    assert prepared.sampling.bad_words == [] and [97, 98] in prepared.sampling.bad_words_token_ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.request_id = "other"
    with pytest.raises(ValidationError):
        prepared.sampling.max_tokens = 1


def test_fit_caps_unless_the_server_is_strict():
    fit = RequestPolicy(prompt="messages", length="fit")
    capped = preparer().prepare(request(max_tokens=1000), fit)
    assert capped.sampling.max_tokens == 28 and capped.capped
    strict = Preparer(preparer().tokenize, VOCAB, CONTEXT,
                      RequestLimits(max_prompt_chars=1000, max_model_len=CONTEXT, strict_max_tokens=True),
                      SamplingDefaults())
    with pytest.raises(InvalidRequestError) as err:
        strict.prepare(request(max_tokens=1000), fit)
    assert err.value.param == "max_tokens" and "(1000 > 32 - 4)" in err.value.message
    assert strict.prepare(request(max_tokens=1000), CAP).capped  # a cap policy caps whatever the server says
