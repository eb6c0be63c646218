"""Reasoning parsers for ``<think>`` ... ``</think>`` models: deepseek_r1 (also registered as
minimax_m2), qwen3, glm45, and seed_oss (``<seed:think>`` ... ``</seed:think>``).

``ThinkReasoningParser`` is the reusable base: a subclass may change ``start_tag`` /
``end_tag``, ``thinking_by_default()`` and ``implicit_end()``. Like every parser here it
decides on text alone and holds back a suffix that could still be a tag, so the result does
not depend on chunking. Reasoning and content are released verbatim, tags removed.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from typing import Any

from llmserve import ParseDelta, ReasoningParser
from llmserve import held_suffix

START, REASON, CONTENT = range(3)


class BufferedReasoningParser(ReasoningParser):
    """A reasoning parser that keeps the text not yet released in one buffer and a state, and
    reads both in ``_run(final)``: ``feed`` grows the buffer in place (not copied per delta, see
    ``StreamingToolParser.feed``), ``finish`` runs once more with ``final``."""

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._buf = ""
        self._state = START
        self._finished = False

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> ParseDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        buf, self._buf = self._buf, ""
        buf += text
        self._buf = buf
        return self._run(False)

    def finish(self) -> ParseDelta:
        if self._finished:
            return ParseDelta()
        self._finished = True
        return self._run(True)

    @abstractmethod
    def _run(self, final: bool) -> ParseDelta:
        """What the buffer releases now (``final``: the output has ended)."""


class ThinkReasoningParser(BufferedReasoningParser):
    """Output = ``[<think>] reasoning </think> content``.

    Leading whitespace and a ``<think>`` at the very start are dropped. Without a start tag
    the output begins in reasoning when ``thinking_by_default()`` (the template put
    ``<think>`` in the prompt), otherwise in content. Reasoning ends at the first ``end_tag``
    (or where ``implicit_end`` says); with no end, everything is reasoning (a cut-off thought).
    """

    start_tag = "<think>"
    end_tag = "</think>"
    # The contract's declared markers (thinking budgets): a subclass with other tags declares them too.
    start_marker, end_marker = start_tag, end_tag
    #: Drop end tags found in the content (a model that closes its thinking twice).
    drop_stray_end_tags = False

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)

    def thinking_by_default(self) -> bool:
        """Whether output without a leading start tag begins in reasoning."""
        return True

    def implicit_end(self, buf: str, limit: int, final: bool) -> tuple[int, int]:
        """Look in ``buf[:limit]`` for text that ends reasoning without the end tag.

        Return ``(index, 0)`` if reasoning ends at ``index`` (content starts there),
        ``(-1, hold)`` otherwise, where reasoning from ``hold`` on must wait for more text
        (``len(buf)`` when nothing needs to wait).
        """
        return -1, len(buf)

    def _run(self, final: bool) -> ParseDelta:
        out = ParseDelta()
        while True:
            buf = self._buf
            if self._state == START:
                stripped = buf.lstrip()
                if stripped.startswith(self.start_tag):
                    self._buf, self._state = stripped[len(self.start_tag):], REASON
                    continue
                if not final and (not stripped or self.start_tag.startswith(stripped)):
                    break
                self._state = REASON if self.thinking_by_default() else CONTENT
                continue
            if self._state == CONTENT:
                if not self.drop_stray_end_tags:
                    out.content += buf
                    self._buf = ""
                    break
                # Hold what could still be the start of an end tag; drop the whole ones.
                keep = 0 if final else held_suffix(buf[-len(self.end_tag):], (self.end_tag,))
                out.content += buf[:len(buf) - keep].replace(self.end_tag, "")
                self._buf = buf[len(buf) - keep:]
                break
            end = buf.find(self.end_tag)
            limit = end if end >= 0 else len(buf)
            cut, hold = self.implicit_end(buf, limit, final)
            if cut >= 0:
                out.reasoning += buf[:cut]
                self._buf, self._state = buf[cut:], CONTENT
                continue
            if end >= 0 and hold >= end:
                out.reasoning += buf[:end]
                self._buf, self._state = buf[end + len(self.end_tag):], CONTENT
                continue
            if not final and end < 0:
                hold = min(hold, len(buf) - held_suffix(buf[-len(self.end_tag):], (self.end_tag,)))
            out.reasoning += buf[:hold]
            self._buf = buf[hold:]
            break
        return out


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """deepseek_r1: everything up to the first ``</think>`` is reasoning (the R1 template puts
    ``<think>`` in the prompt; a generated leading ``<think>`` is dropped); the rest is
    content. No ``</think>`` means all reasoning, as in vLLM. Registered as ``minimax_m2`` too:
    MiniMax-M2's template opens ``<think>`` in the prompt, so its output starts inside the
    thinking, which is this rule. Unlike vLLM, streaming and
    non-streaming agree: text before a leading ``<think>`` that is only whitespace is dropped
    in both, and an empty output gives ``reasoning_content`` null in both."""


_TOOL_CALL = "<tool_call>"
_GENUINE = re.compile(r"\s*(<function[\s=]|\{)")
_SPACE = re.compile(r"\s*")
_MAYBE = ("<function", "{")


class Qwen3ReasoningParser(ThinkReasoningParser):
    """qwen3 (current vLLM behaviour, for Qwen3, Qwen3-Thinking-2507 and Qwen3.5 templates).

    Reasoning runs until ``</think>``; a leading ``<think>`` is dropped. A ``<tool_call>``
    followed by ``<function=`` (Qwen3-Coder format) or, beyond vLLM, by ``{`` (hermes
    format) ends reasoning implicitly, so a call written inside the thinking reaches the
    tool parser. With ``chat_template_kwargs={"enable_thinking": False}`` output that does not
    start with ``<think>`` is all content (vLLM's server skips the parser in that case). A
    ``</think>`` after the first one is dropped from the content (vLLM leaves it there).
    """

    drop_stray_end_tags = True

    def thinking_by_default(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    def implicit_end(self, buf: str, limit: int, final: bool) -> tuple[int, int]:
        start = 0
        while True:
            k = buf.find(_TOOL_CALL, start, limit)
            if k < 0:
                break
            after = k + len(_TOOL_CALL)
            if _GENUINE.match(buf, after):
                return k, 0
            # Positions, not copies of the rest: output full of "<tool_call>" must stay linear.
            j = _SPACE.match(buf, after).end()  # \s* always matches
            left = len(buf) - j
            if not final and (not left or any(left <= len(m) and m.startswith(buf[j:]) for m in _MAYBE)):
                return -1, k  # maybe a call: wait for the next characters
            start = k + 1
        if not final and limit == len(buf):
            return -1, len(buf) - held_suffix(buf[-len(_TOOL_CALL):], (_TOOL_CALL,))
        return -1, len(buf)


class Glm45ReasoningParser(ThinkReasoningParser):
    """glm45 (GLM-4.5, 4.6, 4.7): ``<think>`` ... ``</think>``, a leading ``<think>`` dropped. The
    templates render ``<think></think>`` into the prompt when ``enable_thinking`` is false: then
    output that does not start with ``<think>`` is all content; otherwise it begins in reasoning
    (GLM-4.7 opens the block in the prompt). Stray ``</think>`` tags in the content are dropped."""

    drop_stray_end_tags = True

    def thinking_by_default(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False


class SeedOssReasoningParser(ThinkReasoningParser):
    """seed_oss: ``<seed:think>`` ... ``</seed:think>``. Seed-OSS opens the block itself (its
    template's generation prompt is the bare assistant header), so output that does not start
    with ``<seed:think>`` is all content; a block left open is all reasoning (a cut-off
    thought). Stray end tags in the content are dropped."""

    start_tag = "<seed:think>"
    end_tag = "</seed:think>"
    start_marker, end_marker = start_tag, end_tag
    drop_stray_end_tags = True

    def thinking_by_default(self) -> bool:
        return False
