"""Stop strings over streamed text: matches may span deltas, and nothing past a stop is emitted.

Streaming output equals the non-streaming cut for every way of splitting the text into deltas.
Time and memory are linear: each stop string is matched by a Knuth-Morris-Pratt automaton
whose state is carried from delta to delta, so every character is looked at a bounded number
of times (amortized), and the held-back text is never longer than the longest stop string.
"""

from __future__ import annotations

from array import array
from functools import lru_cache


@lru_cache(maxsize=16)
def _failure(s: str) -> array:
    """KMP failure table of ``s``: ``fail[i]`` is the length of the longest proper prefix of
    ``s[:i + 1]`` that is also its suffix. Cached: the ``n`` sequences of a request (and the
    requests of a client that repeats its stop strings) share one table."""
    fail = array("i", [0]) * len(s)
    k = 0
    for i in range(1, len(s)):
        c = s[i]
        while k and s[k] != c:
            k = fail[k - 1]
        if s[k] == c:
            k += 1
        fail[i] = k
    return fail


class StopChecker:
    """Finds the first stop string in a stream of text deltas.

    Non-streaming definition (what the concatenated output always equals): in the full text,
    take the first position where any stop string *completes*; if several complete there, the
    one that starts earliest (the longest) wins. The output is the text before that stop string,
    or up to and including it with ``include_stop_str_in_output``. Without a match it is the
    whole text.

    Streaming: with ``include_stop_str_in_output=False`` the longest suffix of the unemitted text
    that is a prefix of some stop string is held back, since it may turn out to be (the start
    of) a stop string that must not be shown. With ``include_stop_str_in_output=True`` a partial
    stop string would be emitted in either outcome, so nothing is held back.

    Per stop string the checker keeps one number: how much of the text's end is a prefix of
    that string (the KMP state). The held-back suffix is the longest of those, so no set of
    prefixes is ever built (that was quadratic in the stop string's length).

    After a match the engine finishes the sequence: later :meth:`feed` calls are a caller bug;
    they emit nothing and report the same stop string again rather than raise, so a stray call
    cannot take down the engine loop.
    """

    __slots__ = ("stop", "include_stop_str_in_output", "_fail", "_state", "_held", "_matched")

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match everywhere; SamplingParams rejects them, drop them here too.
        # Deduplicate but keep order so reports are deterministic.
        self.stop: list[str] = list(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._fail = [_failure(s) for s in self.stop]
        self._state = [0] * len(self.stop)  # per stop string: matched prefix length at the text's end
        self._held = ""  # unemitted text (exclude mode only)
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not emitted yet (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take new text; return (text safe to emit now, matched stop string or None)."""
        if self._matched is not None:
            return "", self._matched
        if not self.stop:
            return delta, None
        if not delta:
            return "", None

        best: str | None = None
        best_at = len(delta)  # index in ``delta`` of the last character of the best match
        for i, s in enumerate(self.stop):
            k = self._state[i]
            if k == 0 and s[0] not in delta:
                continue  # the common case: nothing of this stop string here (a C-speed test)
            fail, size = self._fail[i], len(s)
            for j, c in enumerate(delta):
                if j > best_at:
                    break  # a completion after the best one found cannot win
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                    if k == size:
                        # Same end: the longer string starts earlier and wins.
                        if j < best_at or best is None or size > len(best):
                            best, best_at = s, j
                        break
            self._state[i] = k

        if best is not None:
            self._matched = best
            if self.include_stop_str_in_output:
                self._held = ""
                return delta[: best_at + 1], best
            window = self._held + delta
            self._held = ""
            # Every live partial match starts inside the held text, so the cut lies in `window`.
            return window[: len(window) - (len(delta) - best_at - 1) - len(best)], best

        if self.include_stop_str_in_output:
            return delta, None
        # The longest partial match is what may still become a stop string; it never grows by
        # more than the new text, so it lies within held + delta.
        hold = max(self._state)
        window = self._held + delta
        self._held = window[len(window) - hold:] if hold else ""
        return window[: len(window) - hold], None

    def flush(self) -> str:
        """Normal end of text (no match): return whatever was held back."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held
