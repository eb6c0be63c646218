"""Stop strings over streamed text: matches may span deltas, and nothing past a stop is emitted.

Streaming output equals the non-streaming cut for every way of splitting the text into deltas.
"""

from __future__ import annotations


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
    stop string would be emitted in either outcome, so nothing is held back; instead the last
    ``max_len - 1`` emitted characters are kept as search context for matches that span deltas.

    After a match the engine finishes the sequence: later :meth:`feed` calls are a caller bug;
    they emit nothing and report the same stop string again rather than raise, so a stray call
    cannot take down the engine loop.
    """

    __slots__ = (
        "stop",
        "include_stop_str_in_output",
        "_max_len",
        "_prefixes",
        "_held",
        "_context",
        "_matched",
    )

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match everywhere; SamplingParams rejects them, drop them here too.
        # Deduplicate but keep order so reports are deterministic.
        self.stop: list[str] = list(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        # Proper prefixes of all stop strings: the only suffixes worth holding back.
        self._prefixes = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._held = ""  # unemitted text (exclude mode only)
        self._context = ""  # tail of emitted text (include mode only)
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

        # Any match that completes now lies inside `window`: in exclude mode every live partial
        # match starts in the held text (we hold back all of them), in include mode it starts in
        # the last max_len - 1 emitted characters (the context).
        base = len(self._context)
        window = self._context + self._held + delta
        best_end = best_start = -1
        best: str | None = None
        for s in self.stop:
            # The first occurrence of `s` is also its earliest completion.
            start = window.find(s)
            if start < 0:
                continue
            end = start + len(s)
            if best is None or end < best_end or (end == best_end and start < best_start):
                best, best_start, best_end = s, start, end
        if best is not None:
            self._matched = best
            self._held = self._context = ""
            # No earlier match existed, so the chosen one ends in new text: cut >= base in
            # include mode, and in exclude mode base == 0.
            cut = best_end if self.include_stop_str_in_output else best_start
            return window[base:cut], best

        if self.include_stop_str_in_output:
            keep = self._max_len - 1
            # max(): a negative start would wrap around and keep too little.
            self._context = window[max(0, len(window) - keep) :] if keep else ""
            return delta, None

        hold = self._held_suffix_len(window)
        if hold:
            self._held = window[len(window) - hold :]
            return window[: len(window) - hold], None
        self._held = ""
        return window, None

    def flush(self) -> str:
        """Normal end of text (no match): return whatever was held back."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            if text[len(text) - k :] in self._prefixes:
                return k
        return 0
