"""Incremental detokenization: per-token text deltas that add up to a full decode of the output.

Uses the prefix/read offset technique (as in vLLM) on short token windows, so each step costs O(1).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

# What a byte-level / byte-fallback decoder produces for bytes that do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"

# Once this many tokens before the prefix window are dead, drop them so long generations keep
# O(window) memory instead of O(output).
_TRIM_AT = 512

# Modules whose ``_decode`` is exactly "Rust backend decode, then optional clean-up"; only for
# these is calling the backend directly provably identical to ``tokenizer.decode``.
_FAST_DECODE_MODULES = frozenset(
    {
        "transformers.tokenization_utils_tokenizers",  # transformers >= 5
        "transformers.tokenization_utils_fast",  # transformers 4.x
    }
)


class _Vocab(NamedTuple):
    """Per-tokenizer facts, computed once: the engine builds one detokenizer per sequence."""

    byte_ids: frozenset[int]  # "<0xHH>" pieces, when the decoder has a ByteFallback step
    special_ids: frozenset[int]  # what skip_special_tokens drops before the decoder runs


_VOCAB_CACHE: "weakref.WeakKeyDictionary[Any, _Vocab]" = weakref.WeakKeyDictionary()
_NO_VOCAB = _Vocab(frozenset(), frozenset())


def _vocab_facts(tokenizer: Any, backend: Any) -> _Vocab:
    """Find the byte-fallback ids, whose decoding is not prefix-stable (see ``add``)."""
    try:
        return _VOCAB_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    facts = _NO_VOCAB
    decoder = getattr(backend, "decoder", None)
    if decoder is not None and b'"ByteFallback"' in decoder.__getstate__():
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        specials = (i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        facts = _Vocab(frozenset(i for i in byte_ids if i is not None), frozenset(specials))
    try:
        _VOCAB_CACHE[tokenizer] = facts
    except TypeError:  # not weak-referenceable: just recompute next time
        pass
    return facts


def _make_decode(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """Return ``ids -> text`` that behaves exactly like ``tokenizer.decode`` with our options.

    The Python wrapper costs ~7us per call against ~1.5us for the Rust backend; we call it twice
    per token for up to 64 sequences, so the fast path is worth taking when it is provably equal.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode_impl = getattr(type(tokenizer), "_decode", None)
    if (
        backend is not None
        and getattr(decode_impl, "__module__", None) in _FAST_DECODE_MODULES
        # Clean-up rewrites " ." -> "." etc. in Python after the backend; only skip the wrapper
        # when that step is off.
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        backend_decode = backend.decode
        return lambda ids: backend_decode(ids, skip_special_tokens)

    # Generic path (slow tokenizers, custom subclasses). ``spaces_between_special_tokens`` only
    # matters to slow tokenizers; fast ones accept and ignore it, as HF's own decode does.
    kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
    if not spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    return lambda ids: tokenizer.decode(ids, **kwargs)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, one sequence at a time.

    Invariant: ``"".join(deltas) + flush() == tokenizer.decode(output_ids, skip_special_tokens=...)``
    for tokenizers whose decoder is concatenative at character boundaries (byte-level BPE,
    SentencePiece with byte fallback, WordPiece without clean-up).

    How: keep two offsets into the output ids. ``[prefix_offset, read_offset)`` is a window that
    was already emitted and ends on a character boundary; each step decodes
    ``[prefix_offset, end)`` and emits what comes after the window's own text. A result that ends
    in U+FFFD may be a character whose remaining bytes are still to come, so it is held back. The
    window starts at a boundary, so decoding it gives the same characters as the full decode, and
    the decoders' "strip the leading space of the first token" rule cancels out between the two
    decodes. ByteFallback decoders (Llama-style "<0xHH>" pieces) additionally wait until a run of
    byte pieces is closed, because an invalid run rewrites its own valid start (see
    ``_in_byte_run``).

    Windows start at the first *output* token, not in the prompt: a prompt-context window keeps
    e.g. SentencePiece's leading space on the first output token, which a standalone decode of
    the outputs strips, and the invariant would break. ``prompt_token_ids`` is kept for callers.

    Not thread-safe; one instance per sequence, driven by the engine thread.
    """

    __slots__ = (
        "prompt_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "_decode",
        "_byte_ids",
        "_transparent_ids",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_prefix_text",
        "_pieces",
        "_text",
        "_num_tokens",
        "_finished",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = _make_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        facts = _vocab_facts(tokenizer, backend) if backend is not None else _NO_VOCAB
        self._byte_ids = facts.byte_ids
        # Skipped specials vanish before the decoder runs, so byte pieces on either side of one
        # still form a single run.
        self._transparent_ids = facts.special_ids if skip_special_tokens else frozenset()
        # Only the tail of the output ids that a window can still reach (see _TRIM_AT).
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # decode(_ids[_prefix_offset:_read_offset]), cached: it only changes when offsets move.
        self._prefix_text = ""
        self._pieces: list[str] = []
        self._text: str | None = ""  # joined lazily; None means "stale"
        self._num_tokens = 0
        self._finished = False

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of every delta)."""
        if self._text is None:
            self._text = "".join(self._pieces)
            # Collapse so the list stays short; cheap unless read after every token of a huge text.
            self._pieces = [self._text]
        return self._text

    @property
    def num_tokens(self) -> int:
        """How many output tokens have been added."""
        return self._num_tokens

    @property
    def pending_tokens(self) -> int:
        """Tokens whose text is held back (an incomplete character, or nothing printable yet)."""
        return len(self._ids) - self._read_offset

    def add(self, token_ids: list[int]) -> str:
        """Append output tokens; return the newly printable text (possibly "").

        Must not be called after :meth:`flush`.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() called after flush()")
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._num_tokens += len(token_ids)

        full = self._decode(self._ids[self._prefix_offset :])
        prefix_len = len(self._prefix_text)
        # Hold back when nothing new is printable yet (e.g. a skipped special token) or when the
        # text ends in U+FFFD: the next token may complete that character. Advancing only on a
        # non-empty delta also keeps the prefix window's text non-empty, which the leading-space
        # rule of SentencePiece-style decoders needs to cancel out.
        if len(full) <= prefix_len or full[-1] == REPLACEMENT_CHAR:
            return ""
        if self._byte_ids and self._in_byte_run():
            return ""
        return self._emit(full[prefix_len:])

    def flush(self) -> str:
        """End of sequence: emit whatever is still held back, even an incomplete character.

        At the very end the full decode decides, and it renders dangling bytes as U+FFFD.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._read_offset == len(self._ids):
            return ""
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(self._prefix_text) :]
        return self._emit(delta) if delta else ""

    def _in_byte_run(self) -> bool:
        """Whether the newest decoded piece is a "<0xHH>" byte token.

        ByteFallback decodes each maximal run of byte tokens as a whole and, if the run is not
        valid UTF-8, turns *every* byte of it into U+FFFD, including complete characters at its
        start. Text from an open run could thus be rewritten by the next token, so it waits
        until the run is closed by an ordinary token (or by flush).
        """
        ids, byte_ids, transparent = self._ids, self._byte_ids, self._transparent_ids
        # Tokens before read_offset never end in an open run: we never advance inside one.
        for i in range(len(ids) - 1, self._read_offset - 1, -1):
            token = ids[i]
            if token not in transparent:
                return token in byte_ids
        return False

    def _emit(self, delta: str) -> str:
        """Record ``delta`` and slide the window so it starts where the old one ended."""
        end = len(self._ids)
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = self._decode(self._ids[self._prefix_offset : end])
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._pieces.append(delta)
        self._text = None
        return delta
