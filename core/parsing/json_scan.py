"""Incremental JSON for tool-call parsers: validate text as it arrives and know, at every
point, how much of it can be released and how to close it (``JsonScanner``).

``JsonScanner`` checks one JSON value character by character. It never needs the whole value:
after each character it knows whether the text so far is still a valid JSON prefix, and the
last "closable" point: the longest prefix that becomes valid JSON by closing an open string
and the open brackets (``{"a": [1, "x`` closes with ``"]}``; ``{"a": tr`` does not, so it
stays behind ``{``). Releasing arguments only up to that point means that whatever comes
next (more text, the end of the output, a broken character) what was sent is still a prefix
of the final, valid arguments. Raw control characters inside strings are sent escaped.
The call objects built on it are in ``json_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_WS_RUN = re.compile(r"[ \t\n\r]+")
_CTRL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")

VALUE, STR, ESC, UESC, NUM, LIT, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST, DONE, ERROR = range(13)
_WS_STATES = frozenset((VALUE, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST))
# The states whose characters come in runs that ``feed`` takes whole: whitespace between
# tokens, and the plain characters of a string.
_RUNS = {**dict.fromkeys(_WS_STATES, _WS_RUN), STR: _STR_RUN}
# Number automaton: after '-', '0', int digits, '.', fraction digits, 'e', exponent sign, exponent digits.
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(8)
_NUM_END = frozenset((N_ZERO, N_INT, N_FRAC, N_EXP))
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_VALUE_START = frozenset('{["-0123456789tfn')


class JsonScanner:
    """Validates one JSON value incrementally (see the module doc).

    ``feed(text)`` consumes characters until the value is complete or a character is invalid
    (that character is not consumed) and returns how many it consumed. ``text()`` is what was
    consumed (control characters in strings escaped); ``safe``/``safe_raw`` are the lengths of
    the longest closable prefix in ``text()`` and in the raw input; ``closer(depth)`` closes it,
    leaving the outermost ``depth`` containers open. With ``watch_depth=d``, ``events`` gets
    ``("key", name)``, ``("vstart", pos)`` and ``("vend", pos)`` for members of containers
    nested ``d`` deep (``pos`` in ``text()``).
    """

    def __init__(self, watch_depth: int = -1) -> None:
        self.stack: list[str] = []
        self.state = VALUE
        self.is_key = False
        self.num = 0
        self.lit = ""
        self.lit_i = 0
        self.u_left = 0
        self.raw = 0
        self._parts: list[str] = []
        self._text = ""
        self.out_len = 0
        self.safe = 0
        self.safe_raw = 0
        self.safe_quote = False
        self.watch = watch_depth
        self.key_start = 0
        self.events: list[tuple[str, Any]] = []

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def error(self) -> bool:
        return self.state == ERROR

    def text(self) -> str:
        if self._parts:
            self._text += "".join(self._parts)
            self._parts = []
        return self._text

    def closer(self, depth: int = 0) -> str:
        """What closes the text at ``safe``, leaving the first ``depth`` containers open."""
        closing = "".join("}" if c == "{" else "]" for c in reversed(self.stack[depth:]))
        return ('"' if self.safe_quote else "") + closing

    def _emit(self, s: str) -> None:
        self._parts.append(s)
        self.out_len += len(s)

    def _closable(self) -> None:
        st = self.state
        if st in (OBJ_FIRST, ARR_FIRST, AFTER, DONE) or (st == STR and not self.is_key) or \
                (st == NUM and self.num in _NUM_END):
            self.safe, self.safe_raw, self.safe_quote = self.out_len, self.raw, st == STR

    def _value_done(self) -> None:
        if len(self.stack) == self.watch:
            self.events.append(("vend", self.out_len))
        self.state = AFTER if self.stack else DONE

    def _start_value(self, c: str) -> bool:
        if c not in _VALUE_START:
            return False
        if len(self.stack) == self.watch:
            self.events.append(("vstart", self.out_len))
        if c == "{" or c == "[":
            self.stack.append(c)
            self.state = OBJ_FIRST if c == "{" else ARR_FIRST
        elif c == '"':
            self.state, self.is_key = STR, False
        elif c == "-" or c in _DIGITS:
            self.state = NUM
            self.num = N_MINUS if c == "-" else N_ZERO if c == "0" else N_INT
        else:
            self.state, self.lit, self.lit_i = LIT, _LITERALS[c], 1
        return True

    def end(self) -> None:
        """The input is over: a top-level number that is complete becomes the value."""
        if self.state == NUM and self.num in _NUM_END and not self.stack:
            self._value_done()
            self._closable()

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n:
            st = self.state
            if st == DONE or st == ERROR:
                break
            run = _RUNS.get(st)
            if run is not None:
                m = run.match(s, i)
                if m:
                    self._emit(m.group())
                    self.raw += m.end() - i
                    i = m.end()
                    self._closable()
                    continue
            c = s[i]
            if not self._step(c):
                if self.state == NUM:  # a finished number ends at the first character that is not part of it
                    self._value_done()
                    self._closable()
                    continue
                self.state = ERROR
                break
            i += 1
            self.raw += 1
            self._closable()
        return i

    def _step(self, c: str) -> bool:  # noqa: C901 - a flat state machine reads best in one place
        st = self.state
        if st == STR:
            if c == '"':
                self._emit(c)
                if self.is_key:
                    if len(self.stack) == self.watch:
                        self.events.append(("key", json.loads(self.text()[self.key_start:])))
                    self.state = COLON
                else:
                    self._value_done()
            elif c == "\\":
                self._emit(c)
                self.state = ESC
            else:  # a raw control character: send it escaped so the arguments stay valid JSON
                self._emit(_CTRL.get(c, "\\u%04x" % ord(c)))
            return True
        if st == ESC:
            if c not in '"\\/bfnrtu':
                return False
            self._emit(c)
            self.state, self.u_left = (UESC, 4) if c == "u" else (STR, 0)
            return True
        if st == UESC:
            if c not in _HEX:
                return False
            self._emit(c)
            self.u_left -= 1
            if not self.u_left:
                self.state = STR
            return True
        if st == NUM:
            nxt = _num_next(self.num, c)
            if nxt is None:
                if self.num not in _NUM_END:
                    self.state = ERROR
                return False
            self.num = nxt
            self._emit(c)
            return True
        if st == LIT:
            if c != self.lit[self.lit_i]:
                return False
            self._emit(c)
            self.lit_i += 1
            if self.lit_i == len(self.lit):
                self._value_done()
            return True
        if st == VALUE:
            if not self._start_value(c):
                return False
            self._emit(c)
            return True
        if st == ARR_FIRST:
            if c == "]":
                self._emit(c)
                self.stack.pop()
                self._value_done()
                return True
            if not self._start_value(c):
                return False
            self._emit(c)
            return True
        if st in (OBJ_FIRST, OBJ_KEY):
            if c == '"':
                self.key_start = self.out_len
                self._emit(c)
                self.state, self.is_key = STR, True
                return True
            if c == "}" and st == OBJ_FIRST:
                self._emit(c)
                self.stack.pop()
                self._value_done()
                return True
            return False
        if st == COLON:
            if c != ":":
                return False
            self._emit(c)
            self.state = VALUE
            return True
        if st == AFTER:
            top = self.stack[-1]
            if c == ",":
                self._emit(c)
                self.state = OBJ_KEY if top == "{" else VALUE
                return True
            if (c == "}" and top == "{") or (c == "]" and top == "["):
                self._emit(c)
                self.stack.pop()
                self._value_done()
                return True
        return False


def _num_next(state: int, c: str) -> int | None:
    digit = c in _DIGITS
    if state == N_MINUS:
        return N_ZERO if c == "0" else N_INT if digit else None
    if state == N_ZERO:
        return N_DOT if c == "." else N_E if c in "eE" else None
    if state == N_INT:
        return N_INT if digit else N_DOT if c == "." else N_E if c in "eE" else None
    if state in (N_DOT, N_FRAC):
        return N_FRAC if digit else N_E if (c in "eE" and state == N_FRAC) else None
    if state == N_E:
        return N_ESIGN if c in "+-" else N_EXP if digit else None
    return N_EXP if digit else None  # N_ESIGN, N_EXP
