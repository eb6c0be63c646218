"""The sampler's on-device fast path (``sample_on_device``): its draws follow the distribution
temperature, top-k and top-p leave (chi-square), greedy rows are the argmax, logprobs are the raw
log-softmax, and ``Sampler.sample`` takes it on CUDA only for plain parameters."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.plugins.backends.torch.sampler import plain, sample_on_device
from llmserve.sampling import SamplingParams

# chi-square critical values at p = 0.001 by degrees of freedom
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])


def expected(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution HF's warpers leave, in float64."""
    x = LOGITS.double() / temperature
    if top_k:
        x[x < x.topk(top_k).values[-1]] = -math.inf
    p = x.softmax(-1)
    order = p.argsort(descending=True)
    mass_above = p[order].cumsum(0) - p[order]
    x[order[mass_above >= top_p]] = -math.inf
    return x.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.8, 6, 0.9)])
def test_draws_follow_the_warped_distribution(temperature: float, top_k: int, top_p: float) -> None:
    n = 40_000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    gen = torch.Generator().manual_seed(1234)
    tokens, lps = sample_on_device(LOGITS.repeat(n, 1), params, gen)
    want = expected(temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert counts[want == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    support = want > 0
    chi2 = float((((counts - n * want) ** 2) / (n * want))[support].sum())
    assert chi2 < CRITICAL[int(support.sum()) - 1], (counts, n * want)
    raw = torch.log_softmax(LOGITS, -1)
    assert torch.allclose(lps, raw[tokens], atol=1e-6)  # raw logprobs, whatever the warpers did


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=gen)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0, top_p=0.5)
              for i in range(64)]
    tokens, lps = sample_on_device(logits, params, gen)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))
    assert torch.allclose(lps, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0], atol=1e-5)
    all_greedy, _ = sample_on_device(logits, [SamplingParams(temperature=0)] * 64)
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_only_plain_parameters_take_the_fast_path() -> None:
    assert plain(SamplingParams()) and plain(SamplingParams(temperature=0, top_k=5, top_p=0.9, logprobs=0))
    for other in (SamplingParams(seed=1), SamplingParams(logprobs=2), SamplingParams(min_p=0.1),
                  SamplingParams(typical_p=0.5), SamplingParams(logprobs_mode="processed"),
                  SamplingParams(logprob_token_ids=[3])):
        assert not plain(other)
