"""StopChecker: streamed stop-string handling must equal the non-streaming cut for any chunking."""

from __future__ import annotations

import random

import pytest

from llmserve.text.stop import StopChecker


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming definition, written independently: scan end positions left to right; the
    first position where some stop string completes wins, ties go to the earliest start."""
    stops = sorted({s for s in stop if s}, key=len, reverse=True)  # longest = earliest start
    for end in range(1, len(text) + 1):
        for s in stops:
            if text.endswith(s, 0, end):
                return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def stream(text: str, cuts: list[int], stop: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    """Feed ``text`` split at ``cuts``; stop feeding on a match, as the engine does."""
    checker = StopChecker(stop, include)
    bounds = [0, *sorted(cuts), len(text)]
    pieces: list[str] = []
    for a, b in zip(bounds, bounds[1:]):
        emitted, matched = checker.feed(text[a:b])
        pieces.append(emitted)
        if matched is not None:
            assert checker.matched == matched
            assert checker.flush() == ""
            return "".join(pieces), matched, pieces
    pieces.append(checker.flush())
    return "".join(pieces), None, pieces


CASES = [
    ("Hello world. STOP here and more", ["STOP"]),
    ("abcabcabd tail", ["abd"]),
    ("aaaab", ["aab", "ab", "b"]),
    ("xx<|im_end|>yy", ["<|im_end|>", "<|im"]),
    ("one\n\nUser: two", ["\n\nUser:", "\nUser"]),
    ("no stop string in this text", ["zzz", "qq"]),
    ("overlap abab ababc", ["ababc", "bab"]),
    ("emoji 🦙 then 日本語 end", ["🦙 t", "語 e"]),
    ("prefix-only at end: ST", ["STOP"]),
    ("stop at very start", ["stop"]),
    ("ends exactly with STOP", ["STOP"]),
    ("ties: abcd", ["bcd", "abcd", "cd"]),
    ("aaaa", ["aa", "a"]),
    ("", ["x"]),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stop"), CASES)
def test_every_single_split_point(text, stop, include):
    expected = reference(text, stop, include)
    for cut in range(len(text) + 1):
        got, matched, _ = stream(text, [cut], stop, include)
        assert (got, matched) == expected, cut


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stop"), CASES)
def test_character_by_character_and_whole(text, stop, include):
    expected = reference(text, stop, include)
    assert stream(text, list(range(1, len(text))), stop, include)[:2] == expected
    assert stream(text, [], stop, include)[:2] == expected


@pytest.mark.parametrize("include", [False, True])
def test_random_texts_and_chunkings(include):
    # Tiny alphabets make overlapping, repeated and nested stop strings common.
    rng = random.Random(42 + include)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "ab\n", "a🦙"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        ]
        n_cuts = min(rng.randint(0, 8), max(len(text) - 1, 0))
        cuts = rng.sample(range(1, max(len(text), 2)), k=n_cuts)
        got, matched, _ = stream(text, cuts, stop, include)
        assert (got, matched) == reference(text, stop, include), (text, stop, cuts)


def test_prefix_of_stop_is_held_back_then_released():
    checker = StopChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.feed("go ST") == ("go ", None)
    assert checker.held == "ST"
    assert checker.feed("ART") == ("START", None)  # not a stop after all
    assert checker.feed("S") == ("", None)
    assert checker.flush() == "S"


def test_match_across_deltas_excluded():
    checker = StopChecker(["</answer>"], include_stop_str_in_output=False)
    assert checker.feed("42</ans") == ("42", None)
    assert checker.feed("wer> ignored") == ("", "</answer>")


def test_match_across_deltas_included_streams_without_holding_back():
    checker = StopChecker(["</answer>"], include_stop_str_in_output=True)
    # A partial stop string would be emitted in either outcome, so it is not delayed.
    assert checker.feed("42</ans") == ("42</ans", None)
    assert checker.feed("wer> ignored") == ("wer>", "</answer>")


def test_earliest_completion_wins_over_list_order():
    # "b" completes at position 2, before "abc" completes; list order does not matter.
    assert StopChecker(["abc", "b"], False).feed("xabc") == ("xa", "b")
    # Same end position: the one that starts earlier (the longer one) wins.
    assert StopChecker(["bc", "abc"], False).feed("xabc") == ("x", "abc")
    assert StopChecker(["bc", "abc"], True).feed("xabcd") == ("xabc", "abc")


def test_feed_after_match_is_inert():
    checker = StopChecker(["x"], False)
    assert checker.feed("ax") == ("a", "x")
    assert checker.feed("more") == ("", "x")  # caller bug, but harmless
    assert checker.flush() == ""


def test_no_stop_strings_passes_through():
    checker = StopChecker([], include_stop_str_in_output=False)
    assert checker.feed("anything") == ("anything", None)
    assert checker.flush() == ""
    checker = StopChecker(["", "STOP"], False)  # empty strings are ignored, not "match everywhere"
    assert checker.feed("a") == ("a", None)
    assert checker.stop == ["STOP"]


def test_empty_delta():
    checker = StopChecker(["ab"], False)
    assert checker.feed("") == ("", None)
    assert checker.feed("a") == ("", None)
    assert checker.feed("") == ("", None)
    assert checker.feed("b") == ("", "ab")


def test_a_megabyte_stop_string_costs_linear_memory():
    """A 1 MB stop string (four sequences of one request, as with n=4) and text that keeps
    half-matching it: the checkers hold a few MB, not every prefix of the string (the old
    prefix set was ~0.5 TB for this string; 32k characters already cost over a GB)."""
    import tracemalloc

    stop = "ab" * 500_000
    tracemalloc.start()
    try:
        checkers = [StopChecker([stop, "zz"], include) for include in (False, True, False, True)]
        text = ("ab" * 2000 + "x") * 5  # long partial matches that break, then start again
        for checker in checkers:
            out = []
            for i in range(0, len(text), 7):
                emitted, matched = checker.feed(text[i: i + 7])
                assert matched is None
                out.append(emitted)
            out.append(checker.flush())
            assert "".join(out) == text
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 * 1024 * 1024, peak
    # And a long stop string still matches across many deltas.
    checker = StopChecker(["ab" * 5000], False)
    pieces = [checker.feed(("ab" * 6000)[i: i + 3])[0] for i in range(0, 12000, 3)]
    assert checker.matched == "ab" * 5000 and "".join(pieces) == ""
