"""Speculative decoding in the engine: proposals in, verified tokens out (no tensors).

Each step, a running sequence that decodes may carry proposed tokens (``Sequence.draft``) from a
``Proposer`` (``register_proposers`` plugins). The scheduler feeds them after the sequence's
newest token as one chunk, the backend samples at every fed position as if the proposals before
it had been output (``StepItem.num_draft_tokens``), and ``accept`` keeps the proposals up to the
first one the target's own sample disagrees with, plus that sample. For a proposal that is a
function of the context (prompt lookup, a greedy draft model) this emits exactly what the
target alone would: a greedy sample is the argmax either way, and a random one is drawn from the
target's distribution at every kept position (a proposal is kept with probability p(proposal);
on a disagreement the sample is distributed as p without the proposal, renormalised: the
rejection-sampling residual of a one-point proposal).

Per sequence the number proposed adapts: one at first, then one more than were accepted last
time (up to the configured ``num_speculative_tokens``), so one whose proposals hold grows by one
per step (a verifying step costs more per token proposed than the tokens it keeps at a low
acceptance: bench/spec_cost.py);
and a pass whose proposals all missed makes the sequence decode plainly for the next 2, then 4,
8, ... 64 steps (while the misses continue in a row), since a verifying pass costs more than a
plain step even when nothing is kept (free text, where lookups match by chance).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence as Seq

if TYPE_CHECKING:
    from llmserve.config import SpeculativeConfig
    from llmserve.engine.backend import Backend, ModelInfo
    from llmserve.engine.sequence import Sequence

#: The third argument of a proposer whose ``ProposerSpec`` says ``loads_model``: loads the model
#: a name or path points at (as MODEL does: a directory, a .gguf file or a Hugging Face id, fetched
#: when missing) on the server's backend, dtype and device, for the model's context length, and
#: returns its backend (weights loaded, no KV pool yet: see ``Proposer.reserve``) and ``ModelInfo``.
LoadModel = Callable[[str], "tuple[Backend, ModelInfo]"]


@dataclass(slots=True)
class DraftRequest:
    """One sequence's question to a proposer: up to ``k`` tokens likely to follow ``token_ids``
    (prompt and output so far; the first ``num_prompt_tokens`` are the prompt). ``seq_id`` is
    stable for the sequence's life, so a proposer may keep per-sequence state until
    ``Proposer.release``."""

    seq_id: int
    token_ids: Seq[int]
    k: int
    num_prompt_tokens: int = 0


class Proposer(ABC):
    """What a ``register_proposers`` plugin implements: guesses of the next few tokens.

    Built once per model as ``cls(config, info)``: ``config`` is the server's
    ``SpeculativeConfig`` (the method's own settings are its fields, unknown keys are refused
    at start), ``info`` the target model's ``ModelInfo`` (its tokenizer, vocabulary and context
    length). A proposer that runs a model of its own (``ProposerSpec(loads_model=True)``) is built
    as ``cls(config, info, load)``, ``load`` a ``LoadModel``. Called on the engine thread only,
    once per step, with every sequence that may speculate; a wrong guess costs time, never
    correctness, since the target verifies every token. Raise ``llmserve.errors.ConfigError``
    from ``__init__`` or ``reserve`` for a setting or model the proposer cannot work with: the
    server then refuses to start, with that message.
    """

    #: The default of ``disable_by_batch_size`` for this method (None: speculate at any batch).
    max_batch: int | None = None

    def __init__(self, config: "SpeculativeConfig", info: "ModelInfo") -> None:
        self.config = config
        self.info = info

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Up to ``request.k`` token ids per request (fewer or none where nothing fits)."""

    def reserve(self, num_blocks: int, block_size: int, step_tokens: int) -> None:
        """Called once, after the model's KV pool is sized (``num_blocks`` of ``block_size``
        tokens) and before the first step; ``step_tokens`` is the engine's token budget per step.
        A proposer with a model of its own allocates that model's cache here."""
        return None  # optional: a proposer without a cache has nothing to allocate

    def release(self, seq_ids: list[int]) -> None:
        """Forget per-sequence state of sequences that left (finished, aborted, failed)."""
        return None  # optional: a stateless proposer has nothing to forget

    def close(self) -> None:
        """Free what the proposer holds (a model's memory); called once at shutdown."""
        return None  # optional


def accept(drafts: Seq[int], samples: Seq[int | None]) -> int:
    """How many of ``drafts`` stand: ``samples[i]`` is the target's token at the position of
    ``drafts[i]`` (drawn as if ``drafts[:i]`` had been output), so ``drafts[i]`` stands when every
    sample before it agreed. The tokens to emit are ``samples[:accept(...) + 1]``."""
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return n


class SpecTracker:
    """Per-sequence proposal length and the engine's speculation counters (vLLM's metric names
    come from these: drafts, draft tokens, accepted tokens, accepted per position)."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self._k: dict[int, int] = {}
        self._rest: dict[int, tuple[int, int]] = {}  # seq -> (plain steps still to go, passes missed in a row)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_at = [0] * max_k  # accepted proposals by position (0: the first proposed)

    def k_for(self, seq_id: int) -> int:
        """How many tokens to ask the proposer for this step (0: decode plainly; each call while
        a sequence rests counts one of its plain steps)."""
        left, missed = self._rest.get(seq_id, (0, 0))
        if left > 0:
            self._rest[seq_id] = (left - 1, missed)
            return 0
        return self._k.get(seq_id, 1)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1
        self._k[seq_id] = min(self.max_k, accepted + 1)
        missed = self._rest.get(seq_id, (0, 0))[1] + 1 if accepted == 0 else 0
        self._rest[seq_id] = (min(2 ** missed, 64) if missed else 0, missed)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._k.pop(seq_id, None)
            self._rest.pop(seq_id, None)

    def counters(self) -> dict[str, Any]:
        """``EngineStats``' speculation fields, as they are now."""
        return {"spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_accepted_per_pos": tuple(self.accepted_at)}

    @property
    def acceptance(self) -> float | None:
        """Accepted over proposed tokens so far (None before any proposal)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def room_for_drafts(seq: "Sequence", max_model_len: int) -> int:
    """How many proposals ``seq`` can use this step: every emitted token beyond the first is a
    proposal that stood, and the emitted ones must fit in ``max_tokens`` and the context."""
    st: Any = seq.state
    left = min(st.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
    return max(0, left - 1)
