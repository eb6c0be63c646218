"""openai (tool calls) and openai_gptoss (reasoning): gpt-oss's harmony format.

The output is a sequence of messages, each a header, ``<|message|>``, a body and a terminator::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(the second message is one line in the output, cut here to fit the page).

A header starts at ``<|start|>`` (the role follows) or at ``<|channel|>`` (the generation
prompt already wrote ``<|start|>assistant``) and holds the channel (``analysis``: reasoning;
``commentary``: tool calls and preambles; ``final``: the answer), maybe a recipient
``to=...`` (before or after the channel) and a content type (``<|constrain|>json``). A body
ends at ``<|end|>``, ``<|call|>`` or ``<|return|>``, or where the next header starts.

- ``openai`` (tool parser): a message addressed ``to=functions.NAME`` is a call whose
  arguments are its body, a JSON object, **whatever its channel**: gpt-oss models put a large
  share of their calls on ``analysis`` instead of ``commentary``, and reading only the latter
  loses those calls. A call message whose body is not a JSON object, or one addressed to a
  recipient that is not ``functions.NAME`` (gpt-oss's built-in ``browser``/``python`` tools,
  which llmserve does not run), is content, verbatim with its markers. The bodies of other
  messages are content, headers and terminators dropped. Cut off inside a call's object, the
  call is kept, closed into valid JSON.
- ``openai_gptoss`` (reasoning parser): bodies of ``analysis`` messages without a recipient
  are reasoning, bodies of the other messages without a recipient are content; a message
  with a recipient is passed on verbatim as content, so the tool parser after it sees the
  call (alone, without ``openai``, the call's text stays in the content).

All harmony markers are special tokens: both parsers declare ``needs_special_tokens``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Protocol

from llmserve import ParseDelta
from llmserve import ReasoningParser
from llmserve import JsonScanner
from llmserve import StreamingToolParser
from llmserve import held_suffix
from llmserve import InvalidRequestError
from llmserve import Structure, forced_structure

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
OPENERS = (START, CHANNEL)
TERMINATORS = (END, CALL, RETURN)
BODY_STOPS = TERMINATORS + OPENERS
HEADER_STOPS = (MESSAGE, START) + TERMINATORS
MAX_HEADER = 512  # a role, a channel, a recipient and a content type; longer is not a header
_WINDOW = max(map(len, BODY_STOPS))
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_FUNCTION = re.compile(r"functions\.([^\s<>{}]+)")
OUT, HEAD, BODY = range(3)


class Sink(Protocol):
    def outside(self, text: str) -> None: ...
    def open(self, channel: str, recipient: str, header: str) -> None: ...
    def body(self, text: str) -> None: ...
    def close(self, terminator: str, cut: bool) -> None: ...


class HarmonyReader:
    """Splits harmony output into text outside messages, headers, bodies and terminators,
    deciding on text alone (a suffix that may be a marker is held back) and in linear time:
    a search never reads again what an earlier search of the same marker read."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.buf = ""
        self.pos = 0
        self.state = OUT
        self.head = 0  # where the current header starts
        self.found: dict[str, tuple[int, int, int]] = {}  # marker -> (searched from, hit or -1, buffer length)

    def feed(self, text: str, final: bool) -> None:
        if self.pos > 4096 and self.state != HEAD:
            self.buf, self.pos = self.buf[self.pos:], 0
            self.found.clear()  # positions moved
        buf, self.buf = self.buf, ""  # grown in place, not copied per delta
        buf += text
        self.buf = buf
        while self._step(final):
            pass

    def _find(self, marker: str, start: int) -> int:
        """``buf.find(marker, start)``, remembering what earlier searches saw (rescanning the
        rest of the output for a marker that never comes would be quadratic)."""
        memo = self.found.get(marker)
        begin = start
        if memo is not None and start >= memo[0]:
            since, hit, length = memo
            if hit >= start:
                return hit
            if hit < 0:
                begin = max(start, length - len(marker) + 1)
        hit = self.buf.find(marker, begin)
        self.found[marker] = (start, hit, len(self.buf))
        return hit

    def _first(self, markers: tuple[str, ...], start: int) -> tuple[int, str]:
        best, hit = -1, ""
        for marker in markers:
            i = self._find(marker, start)
            if i >= 0 and (best < 0 or i < best):
                best, hit = i, marker
        return best, hit

    def _step(self, final: bool) -> bool:
        if self.state == HEAD:
            return self._header(final)
        buf, pos = self.buf, self.pos
        stops = OPENERS if self.state == OUT else BODY_STOPS
        idx, marker = self._first(stops, pos)
        emit = self.sink.outside if self.state == OUT else self.sink.body
        if idx < 0:
            end = len(buf) if final else len(buf) - held_suffix(buf[-_WINDOW:], stops)
            if end > pos:
                emit(buf[pos:end])
                self.pos = end
            if final and self.state == BODY:
                self.sink.close("", True)
                self.state = OUT
            return False
        if idx > pos:
            emit(buf[pos:idx])
        if marker in OPENERS:
            if self.state == BODY:
                self.sink.close("", False)  # the next header ends the message
            self.state, self.head, self.pos = HEAD, idx, idx
        else:
            self.sink.close(marker, False)
            self.state, self.pos = OUT, idx + len(marker)
        return True

    def _header(self, final: bool) -> bool:
        buf, head = self.buf, self.head
        opener = START if buf.startswith(START, head) else CHANNEL
        idx, marker = self._first(HEADER_STOPS, head + len(opener))
        if idx < 0 or idx + len(marker) > head + MAX_HEADER:
            if final or len(buf) >= head + MAX_HEADER:
                # Not a header after all: its opener is text, and reading goes on after it.
                self.sink.outside(opener)
                self.state, self.pos = OUT, head + len(opener)
                return True
            return False
        if marker != MESSAGE:  # a new header or a terminator first: this one was text
            self.sink.outside(buf[head:idx])
            self.state, self.pos = OUT, idx
            return True
        header = buf[head:idx + len(MESSAGE)]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        self.sink.open(channel.group(1) if channel else "", recipient.group(1) if recipient else "", header)
        self.state, self.pos = BODY, idx + len(MESSAGE)
        return True


def function_name(recipient: str) -> str | None:
    """``NAME`` of a ``functions.NAME`` recipient, else None."""
    m = _FUNCTION.fullmatch(recipient)
    return m.group(1) if m else None


class ReaderFed:
    """``feed`` for both harmony parsers: the text goes to the parser's ``HarmonyReader``, which
    calls the parser back as its sink; what that made is taken out."""

    _reader: HarmonyReader
    _finished: bool
    _take: Callable[[], ParseDelta]

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._reader.feed(text, False)
        return self._take()


class OpenAIToolParser(ReaderFed, StreamingToolParser):
    """openai: harmony tool calls (see the module doc)."""

    # Declared for the linear-time test, which repeats each parser's markers.
    start_markers = (START, CHANNEL, MESSAGE)
    end_marker = CALL

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._reader = HarmonyReader(self)
        self._header = ""
        self._name: str | None = None
        self._verbatim = False
        self._body: list[str] = []

    def finish(self) -> ParseDelta:
        if not self._finished:
            self._reader.feed("", True)
        return super().finish()  # releases the held whitespace once

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        """A forced call as gpt-oss writes one (the prompt ends with ``<|start|>assistant``)::

            <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

        One call whatever ``parallel`` says: ``<|call|>`` ends gpt-oss's turn."""
        def call(function: str, parameters: dict[str, Any]) -> dict[str, Any]:
            if function_name("functions." + function) != function:
                raise InvalidRequestError(f"tool_choice: the function name {function[:60]!r} cannot be written as a "
                                          "harmony recipient", param="tool_choice")
            head = f"{CHANNEL}commentary to=functions.{function} {CONSTRAIN}json{MESSAGE}"
            return Structure.sequence(Structure.text(head), Structure.json(parameters, without=BODY_STOPS),
                                      Structure.text(CALL))
        return forced_structure(tools, name, False, call)

    def _step(self, final: bool) -> bool:
        return False  # the reader drives this parser

    # The reader's sink.
    def outside(self, text: str) -> None:
        self._text(text)

    def open(self, channel: str, recipient: str, header: str) -> None:
        self._header, self._body = header, []
        self._name = function_name(recipient) if recipient else None
        self._verbatim = bool(recipient)

    def body(self, text: str) -> None:
        if self._verbatim:
            self._body.append(text)
        else:
            self._text(text)

    def close(self, terminator: str, cut: bool) -> None:
        if not self._verbatim:
            return
        self._verbatim = False
        body = "".join(self._body)
        self._body = []
        arguments = self._arguments(body, cut) if self._name else None
        if arguments is None:
            self._text(self._header + body + terminator)
            return
        assert self._name is not None  # arguments are only read for a function
        self._call_start(self._name)
        self._call_args(arguments)

    @staticmethod
    def _arguments(body: str, cut: bool) -> str | None:
        """The body as arguments: a JSON object (whitespace around it allowed); cut off, the
        object closed at its last valid point; anything else None."""
        text = body.strip()
        if not text.startswith("{"):
            return None
        sc = JsonScanner()
        n = sc.feed(text)
        if sc.done:
            return sc.text() if n == len(text) else None
        if cut and not sc.error:
            return sc.text()[:sc.safe] + sc.closer(0)
        return None


class OpenAIGptOssReasoningParser(ReaderFed, ReasoningParser):
    """openai_gptoss: harmony reasoning (see the module doc)."""

    needs_special_tokens = True
    start_tag, end_tag = CHANNEL, END  # what the linear-time test repeats
    # Thinking budgets: the analysis message the model opens, closed by <|end|>; the model then
    # writes its next message (the final answer, or a call) itself.
    start_marker, end_marker = CHANNEL + "analysis" + MESSAGE, END

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._reader = HarmonyReader(self)
        self._content: list[str] = []  # joined once per feed: growing a string piece by piece is quadratic
        self._reasoning: list[str] = []
        self._mode = "content"
        self._finished = False

    def finish(self) -> ParseDelta:
        if not self._finished:
            self._finished = True
            self._reader.feed("", True)
        return self._take()

    def _take(self) -> ParseDelta:
        out = ParseDelta("".join(self._content), "".join(self._reasoning))
        self._content, self._reasoning = [], []
        return out

    # The reader's sink.
    def outside(self, text: str) -> None:
        self._content.append(text)

    def open(self, channel: str, recipient: str, header: str) -> None:
        if recipient:
            self._mode = "verbatim"
            self._content.append(header)
        else:
            self._mode = "reasoning" if channel == "analysis" else "content"

    def body(self, text: str) -> None:
        (self._reasoning if self._mode == "reasoning" else self._content).append(text)

    def close(self, terminator: str, cut: bool) -> None:
        if self._mode == "verbatim":
            self._content.append(terminator)
        self._mode = "content"
