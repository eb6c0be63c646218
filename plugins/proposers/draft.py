"""``draft``: a smaller model with the same tokenizer proposes the next tokens, greedily.

The draft runs on the server's backend with a KV pool of its own, as many tokens as the model's
pool (allocated beside it at start). Per sequence it keeps the tokens its cache holds; each step
it first feeds what the sequence gained since (the target's newest token and the proposals that
stood, as decode rows; the whole prompt the first time, in chunks within the step's token
budget), which gives its first proposal, then one decode step per further proposal, every sequence in one batch. A
rejected proposal's KV is simply overwritten next step: the cache is kept up to the first token
that differs from the sequence's own.

Greedy proposals are a function of the context, so the engine's acceptance rule keeps the
output exactly the target's, greedy or sampled (``llmserve.engine.speculation``). The pool is a
cache: when it is full the sequence used longest ago loses its draft state (it is rebuilt from
its tokens if it speculates again), and a sequence that still does not fit decodes plainly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from llmserve import (ConfigError, DraftRequest, KVCacheSpec, ModelInfo, Proposer, SamplingParams, SpeculativeConfig,
                      StepItem)

SETTINGS = ("model",)
SHORT_FEED = 9  # tokens fed as decode rows at most (the newest and up to 8 that stood)
GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _Seq:
    """A sequence as the draft's cache holds it: ``tokens`` have their KV in ``blocks``; the first
    ``confirmed`` of them are the sequence's own (the rest were proposals, maybe rejected)."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0
    used: int = 0  # the last step that asked for it (least recently used goes first)


def same_vocabulary(ours: Any, theirs: Any) -> str | None:
    """None when two tokenizers map the same strings to the same ids, else what differs."""
    a, b = ours.get_vocab(), theirs.get_vocab()
    if len(a) != len(b):
        return f"{len(b)} tokens, not {len(a)}"
    for token, index in a.items():
        if b.get(token) != index:
            return f"token {token!r} is id {b.get(token)}, not {index}"
    return None


class DraftModelProposer(Proposer):
    """vLLM's ``{"method": "draft", "model": ...}`` (llama.cpp's ``--model-draft``)."""


    def __init__(self, config: SpeculativeConfig, info: ModelInfo, load: Any) -> None:
        super().__init__(config, info)
        extra = dict(config.model_extra or {})
        unknown = sorted(set(extra) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"--speculative-config: the draft method has no setting {unknown[0]!r} (it takes "
                              "model, num_speculative_tokens)")
        name = extra.get("model")
        if not isinstance(name, str) or not name:
            raise ConfigError("--speculative-config: the draft method needs \"model\": the draft model's path or "
                              "Hugging Face id")
        self.backend, self.draft = load(name)
        if self.draft.task != "generate":
            raise ConfigError(f"--speculative-config: the draft model {name} is an embedding model")
        differs = same_vocabulary(info.tokenizer, self.draft.tokenizer)
        if differs is not None:
            raise ConfigError(f"--speculative-config: the draft model {name} has another vocabulary than "
                              f"{info.name} ({differs}); a draft must share the model's tokenizer")
        self.name = name
        # On a CPU a step's cost grows with its rows (it is compute-bound past one sequence), and
        # the draft's steps cost more than their proposals save from two sequences on
        # (docs/benchmarks.md); a GPU step costs about the same for 1 row as for 64.
        self.max_batch = None if self.draft.device == "cuda" else 1
        self.eos = frozenset(info.eos_token_ids)
        self._seqs: dict[int, _Seq] = {}
        self._free: list[int] = []
        self.block_size = 16
        self.step_tokens = 2048
        self._tick = 0

    def reserve(self, num_blocks: int, block_size: int, step_tokens: int) -> None:
        self.block_size, self.step_tokens = block_size, step_tokens
        need = math.ceil(self.info.max_model_len / block_size)
        got = self.backend.init_kv_cache(KVCacheSpec(block_size=block_size, num_blocks=num_blocks, min_blocks=need))
        if got < need:
            raise ConfigError(f"--speculative-config: the draft model's KV pool holds {got * block_size} tokens, "
                              f"less than one request's {self.info.max_model_len}")
        self._free = list(range(got - 1, -1, -1))

    # -- one step's proposals ---------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        self._tick += 1
        out: list[list[int]] = [[] for _ in requests]
        budget = self.step_tokens
        first: list[tuple[int, DraftRequest, _Seq, StepItem]] = []
        for i, req in enumerate(requests):
            st = self._seqs.setdefault(req.seq_id, _Seq())
            st.used = self._tick
            keep = self._kept(st, req.token_ids)
            chunk = list(req.token_ids[keep:keep + budget])
            done = keep + len(chunk) == len(req.token_ids)
            if not chunk or not self._room(st, keep + len(chunk) + (req.k - 1 if done else 0)):
                continue
            budget -= len(chunk)
            # A short feed (the newest token after the proposals that stood) goes as decode rows,
            # the backend's cheap path, by asking it to "verify" all but the last token: its
            # sample after the last one is the first proposal, the others are not needed.
            rows = len(chunk) - 1 if done and 1 < len(chunk) <= SHORT_FEED and self.backend.verifies_drafts else 0
            first.append((i, req, st, StepItem(req.seq_id, chunk, keep, st.blocks, sample=done, sampling=GREEDY,
                                               num_draft_tokens=rows)))
            st.tokens.extend(chunk)
            st.confirmed = len(st.tokens)
        if not first:
            return out
        results = self.backend.step([item for *_, item in first])
        going = []
        for (i, req, st, item), result in zip(first, results):
            if item.num_draft_tokens and result.draft_samples:
                result = result.draft_samples[-1]
            if item.sample and result.token_id is not None:
                out[i].append(int(result.token_id))
                going.append((i, req, st))
        for _ in range(max((req.k for _, req, _ in going), default=1) - 1):
            going = [(i, req, st) for i, req, st in going if len(out[i]) < req.k and out[i][-1] not in self.eos]
            if not going:
                break
            items = [StepItem(req.seq_id, [out[i][-1]], len(st.tokens), st.blocks, sampling=GREEDY)
                     for i, req, st in going]
            for (i, _, st), result in zip(going, self.backend.step(items)):
                st.tokens.append(out[i][-1])
                if result.token_id is not None:
                    out[i].append(int(result.token_id))
        return out

    @staticmethod
    def _kept(st: _Seq, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the draft's cache holds; the rest of it is dropped."""
        keep, limit = st.confirmed, min(len(st.tokens), len(ids) - 1)  # the newest token is always fed
        while keep < limit and st.tokens[keep] == ids[keep]:
            keep += 1
        del st.tokens[keep:]
        return keep

    def _room(self, st: _Seq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions in ``st``, taken from the least recently used
        sequences when the pool is short; False (nothing taken) when that is not enough."""
        need = math.ceil(num_tokens / self.block_size) - len(st.blocks)
        if need > len(self._free):
            idle = sorted((s.used, seq_id) for seq_id, s in self._seqs.items() if s.used < self._tick and s.blocks)
            for _, seq_id in idle:
                self.release([seq_id])
                if need <= len(self._free):
                    break
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            st.blocks.append(self._free.pop())
        return True

    def release(self, seq_ids: list[int]) -> None:
        gone = []
        for seq_id in seq_ids:
            st = self._seqs.pop(seq_id, None)
            if st is not None:
                self._free.extend(reversed(st.blocks))
                gone.append(seq_id)
        if gone:
            self.backend.release(gone)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def close(self) -> None:
        self.backend.close()
