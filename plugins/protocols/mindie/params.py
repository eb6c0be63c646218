"""MindIE-family parameters -> core requests, shared by the ``mindie`` and ``triton`` dialects.

MindIE's native ``/infer`` and its Triton-style routes (``/v2/models/{m}/generate``, token
``/infer``) take the same family of ``parameters`` (temperature, top_k, top_p, do_sample,
seed, priority, timeout ...) with slightly different ranges (see each package's ``wire.py``);
this module gives them one meaning. The replies' timing fields are in ``timing.py``.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from llmserve import GenerateRequest, PreparedRequest, RequestPolicy, deadline_after
from llmserve import SamplingParams

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_INPUT_CHARS = 4 * 1024 * 1024          # "0KB < characters <= 4MB"
DEFAULT_MAX_NEW_TOKENS = 20
DEFAULT_PRIORITY = 5
DEFAULT_TIMEOUT = 600
# Errors name MindIE's fields; a ``max_new_tokens`` past the context's room is cut to it.
POLICY = RequestPolicy(prompt="inputs", names={"max_tokens": "max_new_tokens"}, length="cap")


def build_sampling(p: Any) -> tuple[SamplingParams, int | None]:
    """MindIE parameters -> (SamplingParams, seed to report).

    ``do_sample=false`` is greedy; ``do_sample=true`` samples; when ``do_sample`` is absent,
    sampling is on only if a sampling parameter (temperature, top_k, top_p, typical_p) moves
    away from its neutral value (TGI's rule, which MindIE follows: "decided by the other
    post-processing parameters"). A sampled request without a seed gets a random one, which
    is what the reply's ``details.seed`` reports. ``max_new_tokens`` (default 20) is capped to
    the room left in the context (``POLICY``), as MindIE caps it to maxIterTimes.
    """
    temperature = p.temperature
    top_k = getattr(p, "top_k", None)
    top_p = getattr(p, "top_p", None)
    typical_p = getattr(p, "typical_p", None)
    do_sample = p.do_sample
    if do_sample is None:
        do_sample = ((temperature is not None and temperature != 1.0) or bool(top_k)
                     or (top_p is not None and top_p < 1.0) or (typical_p is not None and typical_p < 1.0))
    seed = p.seed
    if do_sample and seed is None:
        seed = random.randint(1, INT32_MAX)
    max_tokens = p.max_new_tokens if p.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    sampling = SamplingParams.build(
        POLICY.names, temperature=(temperature if temperature is not None else 1.0) if do_sample else 0.0,
        top_k=top_k or None, top_p=top_p, typical_p=typical_p,
        repetition_penalty=p.repetition_penalty, seed=seed, max_tokens=max_tokens)
    return sampling, seed


def deadline(timeout: int | float | None) -> float | None:
    """``GenerateRequest.deadline`` for MindIE's ``timeout`` seconds (default 600)."""
    return deadline_after(DEFAULT_TIMEOUT if timeout is None else timeout)


def priority(value: int | None) -> int:
    return DEFAULT_PRIORITY if value is None else value


def new_request(engine: Any, p: Any, text: str | None = None, ids: list[int] | None = None,
                param: str = "inputs") -> tuple[PreparedRequest, int | None]:
    """A prepared core request for ``text`` (or token ``ids``) with MindIE parameters ``p``,
    and the seed to report; a prompt the engine refuses is reported against ``param``. Blocks
    while it tokenizes ``text``: run it in a tokenizer thread (``EngineClient.in_worker``)."""
    sampling, seed = build_sampling(p)
    req = GenerateRequest(prompt=text, prompt_token_ids=None if ids is None else list(ids), sampling=sampling,
                          priority=priority(p.priority), deadline=deadline(p.timeout))
    return engine.prepare(req, replace(POLICY, prompt=param)), seed
