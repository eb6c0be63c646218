"""How many characters one token can cover at most, read from a tokenizer: the bound that lets a
prompt which cannot fit the context be refused from its length alone, before it is tokenized.

Tokenizing costs about a second per megabyte on one core. A prompt of ``n`` characters has at
least ``n / span`` tokens when no token covers more than ``span`` characters, so one longer than
``span`` x the context is refused at once instead of after seconds of work in a tokenizer
thread that other requests share.

The bound holds only where the tokenizer never lets one token cover an unbounded run of text,
so ``max_token_span`` answers ``None`` (no early refusal: the prompt is tokenized) unless it is
sure:

- the model is BPE whose unknown characters do not fuse into one token (WordPiece turns a whole
  unknown word into one ``[UNK]``, Unigram fuses runs of unknown characters, WordLevel maps any
  unknown word to one token);
- the normalizer never deletes text: only ``Prepend``, one-character ``Replace`` with non-empty
  content, case folding and the Unicode forms (composition, NFC/NFKC, joins at most three
  characters into one: the span is multiplied by three for them);
- the pre-tokenizer keeps every character (``ByteLevel``, ``Metaspace``, ``Digits``, ``Split``
  and ``Punctuation`` unless their pieces are ``Removed``): whitespace-splitting ones drop it.

The span is the longest entry of the vocabulary, added tokens included, in characters. For a
byte-level vocabulary one character stands for one byte, and a text has at least as many bytes
as characters; a byte-fallback entry (``<0x0A>``) is longer than the byte it covers, which only
loosens the bound.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

_GROWING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"})
COMPOSE_FACTOR = 3  # Unicode composition joins at most three characters (a Hangul L+V+T) into one


def _state(component: Any) -> Any:
    """A tokenizers component as its JSON description (``None`` when absent)."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(spec: Any) -> int | None:
    """How many input characters one normalized character can stand for (1 or 3), or None when
    the normalizer may delete text."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            inner = _normalizer_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _GROWING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSE_FACTOR
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        if len(pattern.get("String", "")) == 1 and spec.get("content"):
            return 1
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex replaces: may drop text


def _keeps_characters(spec: Any) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in spec.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def max_token_span(tokenizer: Any) -> int | None:
    """The most characters of a prompt one token of ``tokenizer`` can cover, or None when the
    tokenizer gives no such bound (see the module's rules). Reads the vocabulary once: call it
    at start, not per request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        model = backend.model
        if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk and not model.byte_fallback):
            return None
        factor = _normalizer_factor(_state(backend.normalizer))
        if factor is None or not _keeps_characters(_state(backend.pre_tokenizer)):
            return None
        longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=0)
    except (AttributeError, TypeError, ValueError) as exc:  # a tokenizer this reading does not know
        log.debug("no token span bound for this tokenizer: %s", exc)
        return None
    return longest * factor if longest else None
