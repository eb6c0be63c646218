"""``ngram``: prompt lookup. The tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are
proposed: an answer that quotes its prompt (code edits, summaries, agent turns that repeat a
file or a tool result) repeats long runs of it.

Per sequence an index maps each n-gram to where its latest occurrence ended, filled as tokens
arrive (the prompt once, then one position per output token), so a proposal costs a few dict
lookups whatever the context length. Keys are the n-grams' hashes; a collision is caught by
comparing the tokens, and would only cost a rejected proposal anyway.
"""

from __future__ import annotations

from typing import Sequence

from llmserve import ConfigError, DraftRequest, ModelInfo, Proposer, SpeculativeConfig


class _Index:
    """n -> {hash of an n-gram: end (exclusive) of its latest occurrence}, over the positions
    ``< filled``."""

    __slots__ = ("tables", "filled")

    def __init__(self, sizes: range) -> None:
        self.tables: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.filled = 0

    def fill(self, ids: Sequence[int], upto: int) -> None:
        """Index every n-gram that ends at or before ``upto``."""
        for end in range(self.filled + 1, upto + 1):
            for n, table in self.tables.items():
                if end >= n:
                    table[hash(tuple(ids[end - n:end]))] = end
        self.filled = max(self.filled, upto)


class NgramProposer(Proposer):
    """Prompt lookup over prompt and output (vLLM's ``ngram`` method, its
    ``prompt_lookup_min``/``prompt_lookup_max`` settings)."""

    def __init__(self, config: SpeculativeConfig, info: ModelInfo) -> None:
        super().__init__(config, info)
        if config.model_extra:
            raise ConfigError(f"--speculative-config: the ngram method has no setting "
                              f"{sorted(config.model_extra)[0]!r} (it takes num_speculative_tokens, "
                              "prompt_lookup_min, prompt_lookup_max)")
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self._index: dict[int, _Index] = {}

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self._one(r) for r in requests]

    def _one(self, request: DraftRequest) -> list[int]:
        ids, length = request.token_ids, len(request.token_ids)
        index = self._index.get(request.seq_id)
        if index is None:
            index = self._index[request.seq_id] = _Index(self.sizes)
        # Occurrences ending before the last position: the suffix itself is not one.
        index.fill(ids, length - 1)
        for n in reversed(self.sizes):
            if n >= length:
                continue
            suffix = ids[length - n:]
            end = index.tables[n].get(hash(tuple(suffix)))
            if end is not None and list(ids[end - n:end]) == list(suffix):
                return list(ids[end:min(end + request.k, length)])
        return []

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._index.pop(seq_id, None)
