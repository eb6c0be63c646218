"""Reasoning parsers of the 2025-2026 families: deepseek_v3, kimi_k2, mistral and granite.

The first three are ``reasoning.ThinkReasoningParser`` with their own tags and defaults;
granite's thinking is marked by phrases, not tags. Each decides on text alone and holds back
a suffix that could still be a marker, so the result does not depend on chunking.
"""

from __future__ import annotations

from typing import Any

from llmserve import ParseDelta
from llmserve import held_suffix
from llmserve.plugins.tool_parsers.reasoning import (CONTENT, REASON, START, BufferedReasoningParser,
                                                     ThinkReasoningParser)

_KIMI_SECTION = "<|tool_calls_section_begin|>"


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    """deepseek_v3 (V3.1/V3.2's hybrid template): with ``chat_template_kwargs`` ``thinking``
    (or ``enable_thinking``) true, the prompt ends in ``<think>`` and the output is read as
    deepseek_r1 reads it; otherwise the prompt ends in ``</think>`` and output that does not
    start with ``<think>`` is all content."""

    def thinking_by_default(self) -> bool:
        kwargs = self.chat_template_kwargs
        return bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))


class KimiK2ReasoningParser(ThinkReasoningParser):
    """kimi_k2: the model writes ``<think>`` itself (K2-Thinking); output that does not start
    with it is content (K2-Instruct). A tool-call section inside the thinking ends it, so the
    calls reach the tool parser."""

    def thinking_by_default(self) -> bool:
        return False

    def implicit_end(self, buf: str, limit: int, final: bool) -> tuple[int, int]:
        k = buf.find(_KIMI_SECTION, 0, limit)
        if k >= 0:
            return k, 0
        if not final and limit == len(buf):
            return -1, len(buf) - held_suffix(buf[-len(_KIMI_SECTION):], (_KIMI_SECTION,))
        return -1, len(buf)


class MistralReasoningParser(ThinkReasoningParser):
    """mistral (Magistral): ``[THINK]`` ... ``[/THINK]`` (special tokens in the v13
    tokenizers, kept in the text); output that does not start with ``[THINK]`` is content."""

    needs_special_tokens = True
    start_tag, end_tag = "[THINK]", "[/THINK]"
    start_marker, end_marker = start_tag, end_tag

    def thinking_by_default(self) -> bool:
        return False


GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
GRANITE_ENDS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(BufferedReasoningParser):
    """granite (Granite 3.2 with ``thinking``): ``Here is my thought process:`` starts the
    reasoning (as the output's first words, after whitespace), ``Here is my response:`` ends
    it; both phrases are dropped, ``Here's`` is accepted for ``Here is``. Output that does not
    start with the phrase is content; no response phrase means all reasoning (cut off)."""

    start_tag, end_tag = GRANITE_STARTS[0], GRANITE_ENDS[0]  # what the linear-time test repeats
    start_marker, end_marker = start_tag, end_tag  # a spent thinking budget writes "Here is my response:"

    def __init__(self, tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)

    def _run(self, final: bool) -> ParseDelta:
        out = ParseDelta()
        buf = self._buf
        if self._state == START:
            stripped = buf.lstrip()
            start = next((s for s in GRANITE_STARTS if stripped.startswith(s)), None)
            if start is not None:
                buf, self._state = stripped[len(start):], REASON
            elif not final and any(s.startswith(stripped) for s in GRANITE_STARTS):
                return out  # may still be the start phrase
            else:
                self._state = CONTENT
        if self._state == REASON:
            idx, phrase = min(((buf.find(e), e) for e in GRANITE_ENDS if e in buf), default=(-1, ""))
            if idx >= 0:
                out.reasoning += buf[:idx]
                buf, self._state = buf[idx + len(phrase):], CONTENT
            else:
                hold = 0 if final else held_suffix(buf[-len(GRANITE_ENDS[0]):], GRANITE_ENDS)
                out.reasoning += buf[:len(buf) - hold]
                buf = buf[len(buf) - hold:]
        if self._state == CONTENT:
            out.content += buf
            buf = ""
        self._buf = buf
        return out
