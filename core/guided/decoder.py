"""The guided-decoder plugin interface: ``GuidedDecoder`` turns a ``GuidedSpec`` into
per-sequence logits masks for one tokenizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from llmserve.guided.spec import GuidedSpec, MaskFactory


class GuidedDecoder(ABC):
    """Turns a ``GuidedSpec`` into per-sequence logits masks for one tokenizer.

    A plugin contributes a subclass with a ``GuidedDecoderSpec`` record. The server builds
    one instance, on the first request that needs it (never at start-up), as
    ``cls(tokenizer, vocab_size, eos_token_ids)``, and keeps it for its lifetime; expensive
    per-tokenizer preparation (vocabulary tables, prefix trees) belongs in ``__init__``.

    Class attributes:

    - ``name``: a display name (the record's ``name`` is what users type).
    - ``kinds``: the ``GuidedSpec.kind`` values this decoder supports. The server never calls
      ``compile`` with another kind.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """``tokenizer`` is the model's tokenizer (a transformers tokenizer, or anything with
        ``encode``, ``decode`` and ``convert_ids_to_tokens``); ``vocab_size`` is the number of
        logit rows (it may exceed ``len(tokenizer)``); ``eos_token_ids`` end a sequence and
        must be allowed once the constraint is complete, so that generation stops."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @abstractmethod
    def compile(self, spec: GuidedSpec) -> MaskFactory:
        """Validate and prepare ``spec``; return a factory of fresh ``LogitsMask`` objects.

        The server caches the returned factory per ``spec.cache_key()`` and reuses it for every
        request with the same constraint, so it must be stateless; the engine calls it once per
        sequence and each mask then holds that sequence's state. ``mask.allowed(output_ids)``
        is called on the engine thread before every sampled token with all tokens generated so
        far, and returns the ids that may come next (callers must not modify the list).

        Raise ``llmserve.errors.InvalidRequestError(message, param=spec.param)`` for a value
        the client got wrong (an invalid schema or regex, a feature the decoder cannot
        enforce). ``compile`` may be called from worker threads, concurrently.
        """
