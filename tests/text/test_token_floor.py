"""The token span (``core/text/token_floor.py``): the most characters one token can cover, the
bound behind refusing a prompt that cannot fit the context before tokenizing it. The bound must
hold for every text (checked on a real byte-level vocabulary with the texts that stretch it
most), and tokenizers that can fold an unbounded run of text into one token must give none."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llmserve.engine.limits import RequestLimits
from llmserve.engine.prepare import Preparer
from llmserve.engine.defaults import SamplingDefaults
from llmserve.errors import InvalidRequestError
from llmserve.request import GenerateRequest
from llmserve.text.token_floor import COMPOSE_FACTOR, max_token_span

VOCAB = {"a": 0, "b": 1, "ab": 2, "abab": 3, "[UNK]": 4, "▁": 5}


def fast(model: object, normalizer: object = None, pre_tokenizer: object = None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def bpe(**kwargs: object) -> models.BPE:
    return models.BPE(VOCAB, [("a", "b"), ("ab", "ab")], **kwargs)


def test_the_span_of_a_byte_level_vocabulary_bounds_every_text(smollm_tokenizer):
    span = max_token_span(smollm_tokenizer)
    vocab = smollm_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert span == max(map(len, vocab))
    rng = random.Random(7)
    longest = max(vocab, key=len)  # whitespace runs are the longest entries of this vocabulary
    texts = [
        " " * 5000, "\n" + " " * 4999, "\n\n" + "\t" * 3000, "=" * 4000, "-" * 4000,
        "".join(rng.choice("abcdefgh ") for _ in range(5000)),
        "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(2000)),  # three bytes each
        "🙂" * 1000,
        "<|im_start|>" * 300 + "<|im_end|>" * 300,  # special tokens written in the text
        longest.replace("Ċ", "\n").replace("Ġ", " ") * 200,
    ]
    for text in texts:
        ids = smollm_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * span >= len(text), (text[:40], len(ids), len(text))


def test_plain_bpe_gives_its_longest_entry():
    assert max_token_span(fast(bpe())) == 5  # "[UNK]"


@pytest.mark.parametrize("normalizer", [
    normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
    normalizers.Lowercase(), normalizers.NFD(),
])
def test_normalizers_that_never_shrink_the_text_keep_the_span(normalizer):
    assert max_token_span(fast(bpe(), normalizer)) == 5


def test_composing_normalizers_widen_the_span():
    assert max_token_span(fast(bpe(), normalizers.NFKC())) == 5 * COMPOSE_FACTOR


@pytest.mark.parametrize("tokenizer", [
    pytest.param(fast(bpe(), normalizers.Strip()), id="strip"),
    pytest.param(fast(bpe(), normalizers.BertNormalizer()), id="bert-normalizer"),
    pytest.param(fast(bpe(), normalizers.Replace("  ", " ")), id="two-to-one-replace"),
    pytest.param(fast(bpe(), normalizers.Replace("x", "")), id="deleting-replace"),
    pytest.param(fast(bpe(), None, pre_tokenizers.Whitespace()), id="whitespace-dropping"),
    pytest.param(fast(bpe(), None, pre_tokenizers.Split(" ", "removed")), id="removed-split"),
    pytest.param(fast(bpe(unk_token="[UNK]", fuse_unk=True)), id="fused-unknowns"),
    pytest.param(fast(models.WordPiece(VOCAB, unk_token="[UNK]")), id="wordpiece"),
    pytest.param(fast(models.WordLevel(VOCAB, unk_token="[UNK]")), id="wordlevel"),
])
def test_tokenizers_that_can_fold_unbounded_text_into_one_token_give_no_span(tokenizer):
    assert max_token_span(tokenizer) is None


def test_fused_unknowns_with_byte_fallback_are_bounded():
    assert max_token_span(fast(bpe(unk_token="[UNK]", fuse_unk=True, byte_fallback=True))) == 5


def test_a_tokenizer_without_a_backend_gives_no_span():
    class Slow:
        def encode(self, text: str) -> list[int]:
            return [1] * len(text)

    assert max_token_span(Slow()) is None


def test_a_prompt_longer_than_the_span_allows_is_refused_before_tokenizing():
    tokenized: list[str] = []

    def tokenize(text: str, special: bool) -> list[int]:
        tokenized.append(text)
        return [1] * len(text)

    limits = RequestLimits(max_prompt_chars=10_000, max_model_len=32, token_span=4)
    prep = Preparer(tokenize, 100, 32, limits, SamplingDefaults())
    with pytest.raises(InvalidRequestError) as err:
        prep.prepare(GenerateRequest(prompt="x" * 128))  # at least 32 tokens: no room is left
    assert err.value.param == "prompt"
    assert "maximum context length is 32 tokens" in err.value.message
    assert "at least 32 input tokens" in err.value.message
    assert tokenized == []  # refused from its length alone
    limits.check_fits("x" * 127)  # 31.75 tokens at least: it might fit, so it is tokenized
    prep.prepare(GenerateRequest(prompt="x" * 20))
    assert tokenized == ["x" * 20]


def test_no_span_means_no_early_refusal():
    RequestLimits(max_prompt_chars=10_000, max_model_len=32).check_fits("x" * 9_999)
