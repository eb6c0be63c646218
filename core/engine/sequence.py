"""One generated sequence's token and KV-bookkeeping state (pure Python, no tensors).

A request with ``n``/``best_of`` > 1 becomes several sequences sharing a ``request_id``.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # keep this module import-cheap; the engine passes real objects
    from llmserve.request import LogitsMask
    from llmserve.sampling import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Token ids (prompt + generated) plus where their KV lives.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache; the
    scheduler feeds ``token_ids[num_computed_tokens:]`` (or a chunk of it) next.
    ``block_hashes`` is the prefix-cache hash chain of the leading full, computed blocks
    (owned by the BlockManager). ``state`` belongs to the engine loop (detokenizer etc.).
    ``media``: the prompt's images (``llmserve.media.inputs.MediaInput``), where each one's
    expansion sits in the prompt. ``state_slot``: the slot of recurrent state it holds while it runs
    (a hybrid model's; ``engine.state_slots``), None otherwise; ``state_restore``: the saved state
    its first step starts from, after a prefix-cache hit; ``answer_saved``: the chain hash its
    latest state saved inside its answer is kept under (the block manager keeps one a sequence).
    """

    __slots__ = (
        "seq_id", "request_id", "index", "priority", "arrival",
        "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
        "block_table", "block_hashes", "status", "sampling", "mask", "num_preemptions",
        "state", "draft", "media", "state_slot", "state_restore", "answer_saved",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        index: int = 0,
        priority: int = 5,
        arrival: float | None = None,
        mask: LogitsMask | None = None,
        media: tuple[Any, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if sampling is None:
            from llmserve.sampling import SamplingParams

            sampling = SamplingParams()
        self.seq_id: int = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.priority = priority
        self.arrival: float = time.time() if arrival is None else arrival
        self.token_ids: list[int] = list(prompt_token_ids)  # own copy: we append to it
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.sampling = sampling
        self.mask = mask
        self.num_preemptions = 0
        self.state: Any = None  # the engine's postprocess.SeqState (typed there: no import circle)
        self.draft: list[int] = []  # tokens proposed for this step's verification (engine.speculation)
        self.media = media
        self.state_slot: int | None = None
        self.state_restore: int | None = None
        self.answer_saved: int | None = None

    # -- token views -----------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    # -- block helpers ---------------------------------------------------------------------
    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every known token (ceil division)."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """Token ids of logical block ``i`` (the last block may be partial)."""
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.index}, "
            f"prio={self.priority}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
