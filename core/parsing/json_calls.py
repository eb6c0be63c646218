"""Tool-call objects and lists read with ``json_scan.JsonScanner``.

``CheckedCall``, ``CallObject`` and ``CallList`` parse ``{"name": ..., "arguments": {...}}``
and ``[call, ...]``; they report to a sink (the parser) with ``_call_start(name)``,
``_call_args(fragment)`` and ``_text(content)``. All follow the body protocol of
``streaming.RegionToolParser``: ``feed(text) -> consumed``, ``end(cut)``, and the
attributes ``done``, ``failed``, ``committed`` and ``rest``.

Two policies, one per kind of output:

- *checked* (``CheckedCall``, ``CallList(checked=True)``): free model text, where a call may
  be malformed. A call is released whole, once its object is complete and valid: ``name`` a
  non-empty string and the arguments a JSON object (or a JSON string holding one, passed
  through once). Anything else is not a call. In a list, an element that is complete JSON but
  not a valid call is skipped (its text becomes content) and its valid siblings stay calls;
  broken JSON ends the list there. The tool parsers use this.
- *streamed* (``CallObject``, ``CallList``'s default): output valid by construction (forced
  ``tool_choice``), where arguments stream as they are generated and a cut-off call is closed.

Output cut off inside a call (``end(cut=True)``) keeps the call when its name and the start
of its object arguments are known, with the arguments closed into valid JSON; the region's
end marker arriving first (``end(cut=False)``) is malformed output, not a call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, Callable

from llmserve.parsing.json_scan import JsonScanner

_WS_RUN = re.compile(r"[ \t\n\r]+")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def arguments_from_value(raw: str) -> str:
    """The ``arguments`` string for a value that is not an object: ``null`` becomes ``{}``; a
    string holding JSON is passed through once (``"{\\"a\\": 1}"`` gives ``{"a": 1}``)."""
    value = json.loads(raw)
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            inner = json.loads(value, parse_constant=_no_constants)
        except ValueError:
            return raw
        return value if isinstance(inner, (dict, list)) else raw
    return raw


def checked_arguments(raw: str) -> str | None:
    """The ``arguments`` string for the complete JSON value ``raw``, or None if it is not an
    object: ``{...}`` as written, a string holding a JSON object passed through once."""
    if raw.startswith("{"):
        return raw
    value = json.loads(raw)
    if not isinstance(value, str):
        return None
    try:
        inner = json.loads(value, parse_constant=_no_constants)
    except ValueError:
        return None
    return value if isinstance(inner, dict) else None


class _CallBody(ABC):
    """What ``CheckedCall`` and ``CallObject`` share: the scanner reporting the object's keys
    and values, the body protocol's flags, the name rule and ``end``: the object complete at
    the end is ``_complete``, an unfinished one is ``_unfinished(cut)``."""

    def __init__(self, sink: Any, arg_keys: tuple[str, ...], accept: Callable[[str], bool] | None) -> None:
        self.sink = sink
        self.sc = JsonScanner(watch_depth=1)
        self.arg_keys, self.accept = arg_keys, accept
        self.key: str | None = None
        self.role: str | None = None
        self.name_at = self.args_at = self.args_end = -1
        self.committed = self.done = self.failed = False
        self.rest = 0

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        self.sc.end()
        self._events()
        if self.sc.done:
            self._complete()
        else:
            self._unfinished(cut)

    def _value_start(self, at: int) -> str | None:
        """A value of the object starts at ``at``: the first ``name`` and the first arguments key
        take theirs here (marked); the role of this value ("name", "args" or None)."""
        self.role = None
        if self.key == "name" and self.name_at < 0:
            self.role, self.name_at = "name", at
        elif self.key in self.arg_keys and self.args_at < 0:
            self.role, self.args_at = "args", at
        return self.role

    def _valid_name(self, name: Any) -> bool:
        """A non-empty string that ``accept`` (when given) takes."""
        return isinstance(name, str) and bool(name) and (self.accept is None or self.accept(name))

    @abstractmethod
    def _events(self) -> None:
        """What the scanner's progress releases (each kind of call body its own)."""

    @abstractmethod
    def _complete(self) -> None:
        """The object closed: the call is whole."""

    @abstractmethod
    def _unfinished(self, cut: bool) -> None:
        """The text ended inside the object (``cut``: cut off by the output's end)."""


class CheckedCall(_CallBody):
    """One call object of free model text, released whole once complete and valid (the
    *checked* policy of the module doc). ``arg_keys`` name the arguments key (the first one
    present is used; other keys are ignored, key order is free); ``accept(name)`` may reject
    a name. ``complete`` tells a list that the object was whole JSON even when it was not a
    call, so the list can go on after it.
    """

    def __init__(self, sink: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 accept: Callable[[str], bool] | None = None) -> None:
        super().__init__(sink, arg_keys, accept)
        self.name_end = -1
        self.complete = False

    def feed(self, s: str) -> int:
        if self.done:
            return 0
        n = self.sc.feed(s)
        self._events()
        if self.sc.done:
            self._complete()
        elif self.sc.error:
            self.done = self.failed = True
        return n

    def _unfinished(self, cut: bool) -> None:
        if cut:
            self._cut()
        else:
            self.done = self.failed = True

    def _events(self) -> None:
        for kind, value in self.sc.events:
            if kind == "key":
                self.key = value
            elif kind == "vstart":
                self._value_start(value)
            elif self.role == "name":
                self.name_end = value
            elif self.role == "args":
                self.args_end = value
        self.sc.events.clear()

    def _name(self) -> str | None:
        if self.name_end < 0:
            return None
        name = json.loads(self.sc.text()[self.name_at:self.name_end])
        return name if self._valid_name(name) else None

    def _complete(self) -> None:
        self.done, self.complete, self.rest = True, True, self.sc.raw
        name = self._name()
        args = checked_arguments(self.sc.text()[self.args_at:self.args_end]) if self.args_end >= 0 else None
        self._release(name, args)

    def _cut(self) -> None:
        """The output ended inside the object: keep the call if its name and the start of its
        object arguments are known, the arguments closed at the last valid point."""
        self.done, self.rest = True, self.sc.safe_raw
        name, text = self._name(), self.sc.text()
        if self.args_end >= 0:
            args = checked_arguments(text[self.args_at:self.args_end])
        elif self.args_at >= 0 and text[self.args_at] == "{":
            args = text[self.args_at:self.sc.safe] + self.sc.closer(1)
        else:
            args = None
        self._release(name, args)

    def _release(self, name: str | None, args: str | None) -> None:
        if name is None or args is None:
            self.failed = True
            return
        self.committed = True
        self.sink._call_start(name)
        self.sink._call_args(args)


class CallObject(_CallBody):
    """One ``{"name": "...", "arguments": {...}}`` call (``arg_keys`` name the arguments key;
    other keys are ignored; key order does not matter).

    The call is *committed* (``sink._call_start(name)``) as soon as its name is known and its
    object arguments have begun, and from then on the arguments stream up to the closable
    point. Before that nothing is released, so a broken object is simply ``failed``. After it,
    a broken or truncated object closes the arguments (``done``) and ``rest`` says where the
    unused text starts. ``accept(name)`` may reject a name (then ``failed``). Without
    arguments, ``{}`` is sent unless ``require_args`` (then ``failed``).
    """

    def __init__(self, sink: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 require_args: bool = False, accept: Callable[[str], bool] | None = None) -> None:
        super().__init__(sink, arg_keys, accept)
        self.require_args = require_args
        self.name: str | None = None
        self.args_obj = False
        self.args_value: str | None = None
        self.sent = 0

    def feed(self, s: str) -> int:
        if self.done:
            return 0
        n = self.sc.feed(s)
        self._events()
        if not self.done:
            if self.sc.done:
                self._complete()
            elif self.sc.error:
                self._close()
            else:
                self._stream()
        return n

    def _unfinished(self, cut: bool) -> None:
        self._close()

    def _events(self) -> None:
        sc = self.sc
        for kind, value in sc.events:
            if self.done:
                break
            if kind == "key":
                self.key = value
            elif kind == "vstart":
                if self._value_start(value) == "args":
                    self.args_obj = sc.text()[value] == "{"
                    self.sent = value
                    if self.args_obj and self.name is not None:
                        self._commit()
            elif self.role == "name":
                name = json.loads(sc.text()[self.name_at:value])
                if not self._valid_name(name):
                    self.failed = self.done = True
                    break
                self.name = name
                if self.args_at >= 0 and (self.args_obj or self.args_end >= 0):
                    self._commit()
            elif self.role == "args":
                self.args_end = value
                if not self.args_obj:
                    self.args_value = arguments_from_value(sc.text()[self.args_at:value])
                if self.name is not None and not self.committed:
                    self._commit()
        sc.events.clear()

    def _commit(self) -> None:  # object arguments stream after the events (see _stream)
        self.committed = True
        self.sink._call_start(self.name)
        if not self.args_obj and self.args_value is not None:
            self.sink._call_args(self.args_value)

    def _stream(self) -> None:
        if self.committed and self.args_obj:
            end = self.sc.safe if self.args_end < 0 else min(self.sc.safe, self.args_end)
            if end > self.sent:
                self.sink._call_args(self.sc.text()[self.sent:end])
                self.sent = end

    def _complete(self) -> None:
        if not self.committed:
            if self.name is None or self.args_at >= 0 or self.require_args:
                self.failed = self.done = True
                return
            self.committed = True
            self.sink._call_start(self.name)
            self.sink._call_args("{}")
        self._stream()
        self.done, self.rest = True, self.sc.raw

    def _close(self) -> None:
        """Broken or cut off: keep a committed call with closed arguments, else fail."""
        self.done = True
        if not self.committed:
            self.failed = True
            return
        self._stream()
        if self.args_obj and self.args_end < 0:
            self.sink._call_args(self.sc.closer(1))
        self.rest = self.sc.safe_raw


class CallList:
    """``[call, call, ...]``, or a single call object when ``single_ok`` and the text starts
    with ``{``. Streamed (the default): a call that fails before anything was sent fails the
    list if it is the first, otherwise the list ends there (``rest`` points at that call).
    ``checked=True``: the elements are ``CheckedCall`` objects; an element that is whole JSON
    but not a call is skipped and becomes content, released before the next call (held while
    no call was made: a list without any call fails as a whole); broken JSON ends the list."""

    def __init__(self, sink: Any, single_ok: bool = True, checked: bool = False, **call_options: Any) -> None:
        self.sink, self.single_ok, self.checked, self.options = sink, single_ok, checked, call_options
        self.state = "open"
        self.obj: Any = None
        self.unit = 0
        self.raw = 0
        self.single = False
        self.piece: list[str] = []  # raw text of the current element (checked lists)
        self.lead = ""  # whitespace before it: a skipped element is content with its spacing
        self.skipped: list[str] = []  # elements that were not calls, not yet released
        self.committed = self.done = self.failed = False
        self.rest = 0

    # Sink of the elements of a checked list: skipped elements go out before the next call.
    def _call_start(self, name: str, call_id: str | None = None) -> None:
        self._release_skipped()
        self.sink._call_start(name)

    def _call_args(self, fragment: str) -> None:
        self.sink._call_args(fragment)

    def _release_skipped(self) -> None:
        for text in self.skipped:
            self.sink._text(text)
        self.skipped = []

    def _stop(self, rest: int) -> None:
        self.done, self.rest = True, rest
        self.failed = not self.committed  # a list without calls (even ``[]``) stays text
        if self.committed:
            self._release_skipped()

    def feed(self, s: str) -> int:
        i, n = 0, len(s)
        while i < n and not self.done:
            if self.state == "elem":
                assert self.obj is not None  # the "elem" state always has its call object
                k = self.obj.feed(s[i:])
                if self.checked:
                    self.piece.append(s[i:i + k])
                i += k
                self.raw += k
                self._after_elem()
                continue
            m = _WS_RUN.match(s, i)
            if m:
                if self.checked and self.state in ("first", "next"):
                    self.lead += m.group()
                self.raw += m.end() - i
                i = m.end()
                continue
            c = s[i]
            if self.state == "open" and c == "[":
                self.state = "first"
            elif self.state == "open" and c == "{" and self.single_ok:
                self.single = True
                self._new_elem()
                continue
            elif self.state in ("first", "next") and c == "{":
                self._new_elem()
                continue
            elif self.state in ("first", "sep") and c == "]":
                self.state = "closed"
                self._stop(self.raw + 1)
            elif self.state == "sep" and c == ",":
                self.state = "next"
            else:
                self._stop(self.raw)
                break
            i += 1
            self.raw += 1
        return i

    def _new_elem(self) -> None:
        if self.checked:
            self.obj, self.piece, self.lead = CheckedCall(self, **self.options), [self.lead], ""
        else:
            self.obj = CallObject(self.sink, **self.options)
        self.unit, self.state = self.raw, "elem"

    def _after_elem(self) -> None:
        obj = self.obj
        if obj is None or not obj.done:
            return
        self.committed = self.committed or obj.committed
        if obj.failed:
            if self.checked and obj.complete and not self.single:
                self.skipped.append("".join(self.piece))  # whole JSON, not a call: skip it
                self.state = "sep"
            else:
                self._stop(self.unit)
        elif obj.sc.done and not self.single:
            self.state = "sep"
        else:
            if obj.sc.done:
                self.state = "closed"
            self._stop(self.unit + obj.rest)

    def end(self, cut: bool = True) -> None:
        if self.done:
            return
        if self.state == "elem":
            assert self.obj is not None  # the "elem" state always has its call object
            self.obj.end(cut)
            self._after_elem()
        if not self.done:
            self._stop(self.raw)
