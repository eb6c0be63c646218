"""Every case: the non-streaming result is the expected one, and streaming it in any pieces
(every 2-piece split, one character at a time, random pieces, one token at a time) assembles
to exactly the same result."""

from __future__ import annotations

import pytest

from .cases import ALL_CASES, case_id
from .helpers import check_arguments, chunked, pieces, random_chunks, whole

pytestmark = pytest.mark.parametrize("case", ALL_CASES, ids=case_id)


def test_non_streaming_result(case):
    result = whole(case)
    assert result == case.expected
    check_arguments(result)


def test_every_two_piece_split(case):
    expected = whole(case)
    for k in range(len(case.text) + 1):
        halves = [case.text[:k], case.text[k:]]
        assert pieces(case, halves) == expected, f"split at {k}: {halves[0]!r} | {halves[1]!r}"


def test_one_character_at_a_time(case):
    assert pieces(case, list(case.text)) == whole(case)


@pytest.mark.parametrize("size", [2, 3, 5, 8, 13])
def test_fixed_size_pieces(case, size):
    assert pieces(case, chunked(case.text, size)) == whole(case)


def test_random_pieces(case):
    expected = whole(case)
    for seed in range(6):
        parts = random_chunks(case.text, seed)
        assert pieces(case, parts) == expected, f"seed {seed}: {parts}"


def test_one_token_at_a_time(case, smollm_tokenizer):
    from llmserve.text.detokenizer import IncrementalDetokenizer

    ids = smollm_tokenizer.encode(case.text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer, [], skip_special_tokens=False)
    deltas, token_ids = [], []
    for tid in ids:
        deltas.append(detok.add([tid]))
        token_ids.append([tid])
    deltas.append(detok.flush())
    token_ids.append([])
    assert "".join(deltas) == case.text
    assert pieces(case, deltas, token_ids) == whole(case)
