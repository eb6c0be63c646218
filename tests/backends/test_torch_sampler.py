"""Batched sampler of the torch backend: every SamplingParams knob it implements."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from llmserve.engine.backend import StepItem
from llmserve.plugins.backends.torch.sampler import Sampler, prompt_logprobs
from llmserve.sampling import SamplingParams

V = 64
EOS = 2


def sp(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)


def it(seq_id: int = 0, params: SamplingParams | None = None, prompt: list[int] | None = None,
       out: list[int] | None = None, mask: object = None, seed_offset: int = 0) -> StepItem:
    return StepItem(seq_id=seq_id, token_ids=[0], start_pos=0, block_table=[], sampling=params,
                    prompt_ids=prompt or [], output_ids=out or [], mask=mask, seed_offset=seed_offset)


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def tokens(sampler: Sampler, logits: torch.Tensor, items: list[StepItem]) -> list[int]:
    return [o.token_id for o in sampler.sample(logits, items)]


@pytest.fixture(params=["torch", "native-greedy"])
def sampler(request: pytest.FixtureRequest) -> Sampler:
    """The sampler as the backend builds it without and with the native greedy pick (CPU fp32)."""
    s = Sampler(V, [EOS])
    if request.param == "native-greedy":
        from llmserve.plugins.backends.torch.native.ops import elementwise_ops

        ops = elementwise_ops()
        assert ops is not None, "the CPU elementwise kernels must build wherever the suite runs"
        s.greedy_kernel = ops.greedy
    return s


def test_native_greedy_pick_is_used_and_agrees() -> None:
    from llmserve.plugins.backends.torch.native.ops import elementwise_ops

    plain, native = Sampler(V, [EOS]), Sampler(V, [EOS])
    calls = []
    greedy = elementwise_ops().greedy
    native.greedy_kernel = lambda x: calls.append(x.shape) or greedy(x)
    x = logits_rows(5, seed=9)
    items = [it(i, sp(temperature=0)) for i in range(5)]
    a, b = plain.sample(x, items), native.sample(x, items)
    assert calls == [(5, V)]
    assert [o.token_id for o in a] == [o.token_id for o in b]
    assert [o.logprob for o in a] == pytest.approx([o.logprob for o in b], abs=1e-5)
    # A sampled row in the batch takes the general path for everyone.
    native.sample(x, items[:4] + [it(4, sp(temperature=1.0))])
    assert calls == [(5, V)]


def test_greedy_is_argmax(sampler: Sampler) -> None:
    x = logits_rows(8)
    assert tokens(sampler, x, [it(i, sp(temperature=0)) for i in range(8)]) == x.argmax(-1).tolist()


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 1e-4}])
def test_degenerate_filters_equal_greedy(sampler: Sampler, knob: dict) -> None:
    x = logits_rows(32, seed=1)
    for _ in range(3):
        assert tokens(sampler, x, [it(i, sp(**knob)) for i in range(32)]) == x.argmax(-1).tolist()


def _hf_filtered(x: torch.Tensor, warper: object) -> torch.Tensor:
    return torch.isneginf(warper(None, x.clone()))


@pytest.mark.parametrize("name,value", [("top_k", 5), ("top_p", 0.7), ("min_p", 0.1), ("typical_p", 0.6)])
def test_filters_match_transformers(name: str, value: float) -> None:
    from transformers.generation import logits_process as lp

    hf = {"top_k": lp.TopKLogitsWarper(5), "top_p": lp.TopPLogitsWarper(0.7), "min_p": lp.MinPLogitsWarper(0.1),
          "typical_p": lp.TypicalLogitsWarper(0.6)}[name]
    x = logits_rows(6, seed=2)
    params = [sp(**{name: value}) for _ in range(5)] + [sp()]  # last row: filter off
    ours = torch.isneginf(Sampler._warp(x.clone(), params))
    assert torch.equal(ours[:5], _hf_filtered(x[:5], hf))
    assert not ours[5].any()
    # Sampling only ever returns kept tokens.
    s = Sampler(V, [EOS])
    for _ in range(20):
        got = tokens(s, x[:5], [it(i, params[i]) for i in range(5)])
        assert all(not ours[i, t] for i, t in enumerate(got))


def test_temperature_matches_distribution(sampler: Sampler) -> None:
    base = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-50.0] * (V - 4))
    n = 6000
    for temp in (1.0, 2.0):
        got = torch.tensor(tokens(sampler, base.repeat(n, 1), [it(i, sp(temperature=temp)) for i in range(n)]))
        freq = torch.bincount(got, minlength=V)[:4].float() / n
        torch.testing.assert_close(freq, torch.softmax(base / temp, -1)[:4], atol=0.03, rtol=0)


def test_seeded_rows_match_distribution() -> None:
    base = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-50.0] * (V - 4))
    n = 3000
    s = Sampler(V, [EOS])
    got = torch.tensor(tokens(s, base.repeat(n, 1), [it(i, sp(seed=i)) for i in range(n)]))
    freq = torch.bincount(got, minlength=V)[:4].float() / n
    torch.testing.assert_close(freq, torch.softmax(base, -1)[:4], atol=0.03, rtol=0)


def test_logit_bias_forces_token(sampler: Sampler) -> None:
    x = logits_rows(4, seed=3)
    assert tokens(sampler, x, [it(i, sp(temperature=0, logit_bias={7: 100.0})) for i in range(4)]) == [7] * 4
    assert tokens(sampler, x, [it(i, sp(logit_bias={9: 100.0})) for i in range(4)]) == [9] * 4
    best = int(x[0].argmax())
    assert tokens(sampler, x[:1], [it(0, sp(temperature=0, logit_bias={best: -100.0}))])[0] != best


def test_bad_words(sampler: Sampler) -> None:
    x = torch.zeros(1, V)
    x[0, 5], x[0, 6] = 10.0, 9.0
    single = sp(temperature=0, bad_words_token_ids=[[5]])
    assert tokens(sampler, x, [it(0, single)]) == [6]
    multi = sp(temperature=0, bad_words_token_ids=[[3, 4, 5]])
    assert tokens(sampler, x, [it(0, multi, out=[1, 3, 4])]) == [6]   # prefix generated: banned
    assert tokens(sampler, x, [it(0, multi, out=[3, 1, 4])]) == [5]   # prefix absent: allowed
    assert tokens(sampler, x, [it(0, multi, prompt=[3, 4])]) == [5]   # the prompt does not count


def test_min_tokens_bans_eos_and_stop_ids(sampler: Sampler) -> None:
    x = torch.zeros(1, V)
    x[0, EOS], x[0, 9], x[0, 11] = 10.0, 9.0, 8.0
    p = sp(temperature=0, min_tokens=3, stop_token_ids=[9])
    assert tokens(sampler, x, [it(0, p, out=[4, 4])]) == [11]
    assert tokens(sampler, x, [it(0, p, out=[4, 4, 4])]) == [EOS]
    assert tokens(sampler, x, [it(0, sp(temperature=0, ignore_eos=True))]) == [EOS]  # engine's job


def test_repetition_penalty(sampler: Sampler) -> None:
    x = torch.full((1, V), -5.0)
    x[0, 3], x[0, 4] = 2.0, 1.5
    p = sp(temperature=0, repetition_penalty=2.0)
    assert tokens(sampler, x, [it(0, p, prompt=[3])]) == [4]      # prompt tokens count (HF)
    assert tokens(sampler, x, [it(0, p, out=[3])]) == [4]
    # Negative logits are multiplied: -0.4 * 2 < -0.5.
    y = torch.full((1, V), -9.0)
    y[0, 3], y[0, 4] = -0.4, -0.5
    assert tokens(sampler, y, [it(0, p, out=[3])]) == [4]
    assert tokens(sampler, y, [it(0, sp(temperature=0), out=[3])]) == [3]


def test_frequency_and_presence_penalties(sampler: Sampler) -> None:
    x = torch.full((1, V), -5.0)
    x[0, 3], x[0, 4] = 2.0, 1.5
    assert tokens(sampler, x, [it(0, sp(temperature=0, frequency_penalty=0.2), out=[3])]) == [3]
    assert tokens(sampler, x, [it(0, sp(temperature=0, frequency_penalty=0.2), out=[3, 3, 3])]) == [4]
    assert tokens(sampler, x, [it(0, sp(temperature=0, presence_penalty=0.6), out=[3])]) == [4]
    # OpenAI semantics: prompt tokens are not penalised.
    assert tokens(sampler, x, [it(0, sp(temperature=0, presence_penalty=2.0), prompt=[3, 3])]) == [3]


def test_penalties_match_naive_reference(sampler: Sampler) -> None:
    """Rows of different lengths with repeats: the vectorised penalties equal a per-token loop."""
    g = torch.Generator().manual_seed(11)
    x = logits_rows(4, seed=12)
    items = []
    for i in range(4):
        prompt = torch.randint(0, 12, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        out = torch.randint(0, 12, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        params = sp(repetition_penalty=1.3 + i / 10, frequency_penalty=0.3 * i, presence_penalty=0.5 - i / 10)
        items.append(it(i, params, prompt=prompt, out=out))
    want = x.clone()
    for i, item in enumerate(items):
        p = item.sampling
        for t in set(item.prompt_ids + item.output_ids):
            want[i, t] = want[i, t] / p.repetition_penalty if want[i, t] > 0 else want[i, t] * p.repetition_penalty
        for t in set(item.output_ids):
            want[i, t] -= p.frequency_penalty * item.output_ids.count(t) + p.presence_penalty
    got = x.clone()
    sampler._penalise(got, items, [item.sampling for item in items])
    torch.testing.assert_close(got, want)


def test_wide_nucleus_falls_back_to_full_sort() -> None:
    """top_p needing more tokens than the fast path's candidates still matches transformers."""
    from transformers.generation.logits_process import TopPLogitsWarper

    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(13)) * 0.1  # flat: huge nucleus
    x[1, :10] += 20.0                                                            # peaked row
    ours = x.clone()
    Sampler._top_p(ours, torch.tensor([[0.9], [0.9], [0.5]]), candidates=64)
    for i, p in enumerate((0.9, 0.9, 0.5)):
        want = TopPLogitsWarper(p)(None, x[i:i + 1].clone())
        assert torch.equal(torch.isneginf(ours[i:i + 1]), torch.isneginf(want))


class OnlyAllow:
    def __init__(self, ids: list[int] | None) -> None:
        self.ids, self.seen = ids, []

    def allowed(self, output_token_ids: list[int]) -> list[int] | None:
        self.seen.append(list(output_token_ids))
        return self.ids


def test_logits_mask(sampler: Sampler) -> None:
    x = logits_rows(3, seed=4)
    masks = [OnlyAllow([10, 11]), OnlyAllow(None), OnlyAllow([20])]
    items = [it(0, sp(), out=[1, 2], mask=masks[0]), it(1, sp(temperature=0), mask=masks[1]),
             it(2, sp(temperature=0), mask=masks[2])]
    for _ in range(10):
        got = tokens(sampler, x, items)
        assert got[0] in (10, 11) and got[1] == int(x[1].argmax()) and got[2] == 20
    assert masks[0].seen[0] == [1, 2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_constraint_wins_over_min_tokens_and_bad_words(sampler: Sampler, temperature: float) -> None:
    """A constraint that allows only EOS (a forced JSON value is complete) while min_tokens bans
    it picks EOS, not whatever token an all-banned row would give; a row where something is
    left keeps every ban."""
    x = logits_rows(3, seed=6)
    items = [it(0, sp(temperature=temperature, min_tokens=20), mask=OnlyAllow([EOS])),
             it(1, sp(temperature=temperature, bad_words_token_ids=[[7]]), mask=OnlyAllow([7])),
             it(2, sp(temperature=temperature, min_tokens=20), mask=OnlyAllow([EOS, 9]))]
    for _ in range(5):
        assert tokens(sampler, x.clone(), items) == [EOS, 7, 9]


def test_contradictory_constraints_never_nan(sampler: Sampler) -> None:
    x = logits_rows(1, seed=5)
    p = sp(bad_words_token_ids=[[20]], logprobs=3)
    (o,) = sampler.sample(x, [it(0, p, mask=OnlyAllow([20]))])
    assert 0 <= o.token_id < V and math.isfinite(o.logprob)


def test_seeded_alone_equals_in_batch() -> None:
    x = logits_rows(5, seed=6)
    seeded = sp(seed=1234, temperature=0.9, top_p=0.95)
    alone, batched = Sampler(V, [EOS]), Sampler(V, [EOS])
    a = [tokens(alone, x[2:3], [it(7, seeded, seed_offset=3)])[0] for _ in range(8)]
    b = []
    for _ in range(8):
        batch = [it(1, sp()), it(2, sp(seed=99)), it(7, seeded, seed_offset=3), it(4, sp(temperature=0)), it(5, sp())]
        b.append(tokens(batched, x, batch)[2])
    assert a == b


def test_different_seeds_differ_and_release() -> None:
    x = torch.zeros(1, V)  # uniform: every draw is a fresh coin
    s = Sampler(V, [EOS])
    seq_a = [tokens(s, x, [it(1, sp(seed=1))])[0] for _ in range(10)]
    seq_b = [tokens(s, x, [it(2, sp(seed=2))])[0] for _ in range(10)]
    assert seq_a != seq_b
    s.release([1])
    assert [tokens(s, x, [it(1, sp(seed=1))])[0] for _ in range(10)] == seq_a  # fresh generator after release
    # seed_offset gives the n sequences of one request different streams.
    seq_c = [tokens(s, x, [it(3, sp(seed=1), seed_offset=1)])[0] for _ in range(10)]
    assert seq_c != seq_a


def test_logprobs_raw_and_processed(sampler: Sampler) -> None:
    x = logits_rows(3, seed=7)
    raw = torch.log_softmax(x, -1)
    outs = sampler.sample(x, [it(0, sp(logprobs=4)), it(1, sp(temperature=0, logprobs=0)), it(2, sp())])
    for i, o in enumerate(outs):
        assert o.logprob == pytest.approx(float(raw[i, o.token_id]), abs=1e-5)
    assert [t for t, _ in outs[0].top] == raw[0].topk(4).indices.tolist()
    assert [v for _, v in outs[0].top] == pytest.approx(raw[0].topk(4).values.tolist(), abs=1e-5)
    assert outs[1].top == [] and outs[2].top is None
    (o,) = sampler.sample(x[:1], [it(0, sp(temperature=0.5, logprobs=2, logprobs_mode="processed"))])
    proc = torch.log_softmax(x[0] / 0.5, -1)
    assert o.logprob == pytest.approx(float(proc[o.token_id]), abs=1e-5)
    assert [t for t, _ in o.top] == proc.topk(2).indices.tolist()


def test_no_inf_or_nan_in_logprobs(sampler: Sampler) -> None:
    x = torch.full((1, V), float("-inf"))
    x[0, 3] = 1.0
    x[0, 4] = 0.5
    (o,) = sampler.sample(x, [it(0, sp(logprobs=5))])
    values = [o.logprob] + [v for _, v in o.top]
    assert all(math.isfinite(v) for v in values) and -9999.0 in values
    (o,) = sampler.sample(torch.zeros(1, V), [it(0, sp(temperature=0, logprobs=3, logprobs_mode="processed",
                                                       logit_bias={5: 10.0}), mask=OnlyAllow([5]))])
    assert o.token_id == 5 and o.logprob == pytest.approx(0.0, abs=1e-6)
    assert [v for _, v in o.top][1:] == [-9999.0, -9999.0]


def test_prompt_logprobs() -> None:
    x = logits_rows(4, seed=8)
    got = prompt_logprobs(x, [5, 6, 7], 2)  # last row has no target
    ref = torch.log_softmax(x, -1)
    assert len(got) == 3
    for k, (lp, top) in enumerate(got):
        assert lp == pytest.approx(float(ref[k, 5 + k]), abs=1e-5)
        assert [t for t, _ in top] == ref[k].topk(2).indices.tolist()
    assert prompt_logprobs(x, [1], 0) == [(pytest.approx(float(ref[0, 1]), abs=1e-5), [])]
