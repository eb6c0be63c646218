"""The streaming skeleton shared by the built-in tool parsers.

Every decision is taken on text alone and only once the text received so far settles it: a
suffix that could still be the start of a marker is held back, and a call is not started
before its name is complete. So the assembled result is the same however the output is cut
into pieces, and "non-streaming" is just one ``feed`` of everything followed by ``finish``.

``RegionToolParser`` handles formats made of plain text with *regions*: a start marker, a
body (parsed by a body object from ``json_calls``/``pythonic``), and an optional end marker.

Content rules shared by all built-in parsers: whitespace right before a call, between calls
and after the last call is dropped; other text around calls is kept as content (nothing is
lost); a region whose body made no call is content verbatim, markers included. A body that
made calls and then stops (a broken list element) leaves the unused text of the region as
content; if the output ends inside the region (cut off by max_tokens), the body closes what
it can (``end(cut=True)``) and the unfinished rest is dropped. Which calls a body makes is its
own rule: the checked bodies of ``json_calls`` make a call only from complete, valid text.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from typing import Any, Callable

from llmserve.parsing.contract import ParseDelta, ToolCallDelta, ToolParser, new_call_id

_LEAD_WS = re.compile(r"\s*")


def held_suffix(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def earliest(markers: tuple[str, ...] | list[str], find: Callable[[str], int]) -> tuple[int, str]:
    """``(index, marker)`` of the marker that ``find`` (an index, or -1: absent) places first,
    the longest on ties, or ``(-1, "")``."""
    best, hit = -1, ""
    for marker in markers:
        i = find(marker)
        if i >= 0 and (best < 0 or i < best or (i == best and len(marker) > len(hit))):
            best, hit = i, marker
    return best, hit


def find_first(text: str, markers: tuple[str, ...] | list[str], start: int) -> tuple[int, str]:
    """``(index, marker)`` of the earliest marker at or after ``start`` (longest on ties), or ``(-1, "")``."""
    return earliest(markers, lambda marker: text.find(marker, start))


class StreamingToolParser(ToolParser):
    """``feed``/``finish`` over a text buffer driven by ``_step(final)`` (return True while it
    makes progress). Subclasses release text with ``_text`` and calls with ``_call_start`` /
    ``_call_args``."""

    needs_special_tokens = True
    #: Call ids: ``id_prefix`` + ``id_length`` random letters and digits.
    id_length, id_prefix = 24, "call_"

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._buf = ""
        self._pos = 0
        self._out = ParseDelta()
        self._parts: list[str] = []  # content released since the last _take (joined once, not grown)
        self._ws = ""
        self._found: dict[str, tuple[int, int, int]] = {}  # marker -> (searched from, hit or -1, buffer length)
        self._calls = 0
        self._finished = False

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._compact()
            # Through a local with the attribute cleared: CPython then grows the string in place
            # instead of copying the whole buffer per delta (quadratic while a region stays open).
            buf, self._buf = self._buf, ""
            buf += text
            self._buf = buf
            while self._step(False):
                pass
        return self._take()

    def finish(self) -> ParseDelta:
        if not self._finished:
            self._finished = True
            while self._step(True):
                pass
            if not self._calls:
                self._parts.append(self._ws)
            self._ws = ""
        return self._take()

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume from ``self._buf[self._pos:]``; True if progress was made."""

    def _compact(self) -> None:
        if self._pos > 4096:
            self._buf, self._pos = self._buf[self._pos:], 0
            self._found.clear()  # positions moved

    def _take(self) -> ParseDelta:
        out, self._out = self._out, ParseDelta()
        if self._parts:
            # One join per feed: growing a string attribute piece by piece copies it every time,
            # quadratic when one feed holds the whole output (the non-streaming case).
            out.content += "".join(self._parts)
            self._parts = []
        return out

    def _find(self, marker: str, start: int) -> int:
        """``self._buf.find(marker, start)``, remembering what earlier searches saw: the parser
        searches again from each region it tries, and rescanning the rest of the output every
        time (a marker that never comes, thousands of regions) would be quadratic."""
        buf = self._buf
        memo = self._found.get(marker)
        begin = start
        if memo is not None and start >= memo[0]:
            since, hit, length = memo
            if hit >= start:
                return hit  # nothing between ``since`` and ``hit``, and start lies in there
            if hit < 0:  # nothing started before length - len(marker) + 1 when last searched
                begin = max(start, length - len(marker) + 1)
        hit = buf.find(marker, begin)
        self._found[marker] = (start, hit, len(buf))
        return hit

    def _find_first(self, markers: tuple[str, ...] | list[str], start: int) -> tuple[int, str]:
        """``find_first`` over the buffer, with ``_find``'s memory."""
        return earliest(markers, lambda marker: self._find(marker, start))

    def _text(self, s: str) -> None:
        """Release content; trailing whitespace waits until we know what follows it."""
        if not s:
            return
        s = self._ws + s
        cut = len(s.rstrip())
        if cut:
            self._parts.append(s[:cut])
        self._ws = s[cut:]

    def _call_start(self, name: str, call_id: str | None = None) -> None:
        self._ws = ""
        self._out.tool_calls.append(ToolCallDelta(self._calls, call_id or self._new_id(), name, ""))
        self._calls += 1

    def _call_args(self, fragment: str) -> None:
        if not fragment:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == self._calls - 1:
            calls[-1].arguments += fragment
        else:
            calls.append(ToolCallDelta(self._calls - 1, arguments=fragment))

    def _known(self, name: str) -> bool:
        """Whether ``name`` is one of the request's tools (any name when it lists none)."""
        return not self.tool_names or name in self.tool_names

    def _new_id(self) -> str:
        return new_call_id(self.id_length, self.id_prefix)


NORMAL, BODY, TAIL = range(3)
# How many regions may be retried one inside the other after failing (a call object inside an
# object that is not a call, and so on). Each retry reads the rest of the failed region again,
# so without a bound `{"a": {"a": {"a": ...` left open costs time quadratic in its length.
MAX_NESTED_RETRIES = 4
BODY_PIECE = 4096  # characters handed to a region's body at a time


class RegionToolParser(StreamingToolParser):
    """Text with call regions: ``start_markers`` open a region anywhere, ``lead_markers`` only
    as the first non-whitespace of the output; a marker in ``body_markers`` is the body's own
    first character (``{``, ``[``). The body ends by itself or at ``end_marker``. After a
    region, text up to the end marker is content and the marker is dropped; ``separators``
    right after a call (like ``;``) are dropped too."""

    start_markers: tuple[str, ...] = ()
    lead_markers: tuple[str, ...] = ()
    body_markers: frozenset[str] = frozenset()
    end_marker: str | None = None
    separators: str = ""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._mode = NORMAL
        self._fresh = bool(self.lead_markers)
        self._sep = False
        self._keep_tag = False
        self._marker = ""
        self._mark = self._bstart = self._bpos = 0
        self._body: Any = None
        self._window = max(len(m) for m in (*self.start_markers, self.end_marker or "", " "))
        self._failed_to = 0  # end of the text read by the regions that failed lately
        self._retries = 0    # regions opened inside it since

    @abstractmethod
    def _new_body(self, marker: str) -> Any:
        """A body object for the region opened by ``marker`` (see ``json_calls.CallObject``)."""

    def _compact(self) -> None:
        if self._mode != BODY:
            shift = self._pos
            super()._compact()
            if self._pos == 0 and shift:
                self._failed_to = max(0, self._failed_to - shift)

    def _step(self, final: bool) -> bool:
        if self._mode == BODY:
            return self._region(final)
        if self._mode == TAIL:
            return self._tail(final)
        return self._normal(final)

    def _normal(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        if self._fresh or self._sep:
            lead = _LEAD_WS.match(buf, pos)
            assert lead is not None  # \s* always matches
            j = lead.end()
            self._text(buf[pos:j])
            self._pos = pos = j
            if j == len(buf):
                return False
            if self._sep:
                self._sep = False
                if buf[j] in self.separators:
                    self._pos = j + 1
                    return True
            if self._fresh:
                rest = buf[j:j + max(map(len, self.lead_markers))]
                for marker in self.lead_markers:
                    if rest.startswith(marker):
                        self._fresh = False
                        return self._open(j, marker)
                if not final and any(m.startswith(rest) for m in self.lead_markers):
                    return False
                self._fresh = False
        idx, marker = self._find_first(self.start_markers, pos)
        if idx < 0:
            end = len(buf) if final else len(buf) - held_suffix(buf[-self._window:], self.start_markers)
            self._text(buf[pos:end])
            self._pos = max(pos, end)
            return False
        self._text(buf[pos:idx])
        return self._open(idx, marker)

    def _open(self, idx: int, marker: str) -> bool:
        self._marker, self._mark = marker, idx
        self._bstart = self._bpos = idx if marker in self.body_markers else idx + len(marker)
        self._body = self._new_body(marker)
        self._mode = BODY
        return True

    def _region(self, final: bool) -> bool:
        buf, body = self._buf, self._body
        limit, tag = len(buf), -1
        if self.end_marker:
            tag = self._find(self.end_marker, self._bpos)
            if tag >= 0:
                limit = tag
            elif not final:
                limit -= held_suffix(buf[-len(self.end_marker):], (self.end_marker,))
        # In pieces: a body that fails after a few characters must not cost a copy of all the
        # text after it (one per region tried: quadratic over a long output in one feed).
        while limit > self._bpos and not body.done:
            piece = buf[self._bpos:min(limit, self._bpos + BODY_PIECE)]
            used = body.feed(piece)
            self._bpos += used
            if used < len(piece):
                break
        truncated = False
        if not body.done:
            if tag < 0 and not final:
                return False
            truncated = tag < 0  # the output ended inside the region
            body.end(truncated)  # False: the end marker came before the body was complete
        self._body = None
        if body.failed and not body.committed:  # nothing was sent: the region is plain text
            if self.end_marker:
                self._text(self._marker)
                self._pos, self._keep_tag, self._mode = self._bstart, True, TAIL
            else:
                step = 1 if self._marker in self.body_markers else len(self._marker)
                if self._mark < self._failed_to:
                    self._retries += 1
                else:
                    self._retries = 0
                self._failed_to = max(self._failed_to, self._bpos)
                if self._retries >= MAX_NESTED_RETRIES:
                    step = max(step, self._failed_to - self._mark)  # what the failed regions read is text
                    self._retries = 0
                self._text(buf[self._mark:self._mark + step])
                self._pos, self._mode = self._mark + step, NORMAL
            return True
        # A cut-off region keeps its calls (the open one closed); its unfinished rest is dropped.
        self._pos = len(buf) if truncated else self._bstart + body.rest
        self._keep_tag = False
        self._mode = TAIL if self.end_marker else NORMAL
        self._sep = bool(self.separators) and self._mode == NORMAL
        return True

    def _tail(self, final: bool) -> bool:
        buf, pos = self._buf, self._pos
        stops = self.start_markers + ((self.end_marker,) if self.end_marker else ())  # TAIL: always set
        idx, marker = self._find_first(stops, pos)
        if idx < 0:
            end = len(buf) if final else len(buf) - held_suffix(buf[-self._window:], stops)
            self._text(buf[pos:end])
            self._pos = max(pos, end)
            if final:
                self._mode = NORMAL
            return final
        self._text(buf[pos:idx])
        if marker == self.end_marker:
            if self._keep_tag:
                self._text(marker)
            else:
                self._ws = ""
            idx += len(marker)
        self._pos, self._mode = idx, NORMAL
        self._sep = bool(self.separators) and not self._keep_tag
        return True
