"""The backend contract: what a model runner plugin implements for the engine.

The core owns scheduling and KV *bookkeeping* (which block belongs to which sequence);
the backend owns the model, the KV *tensors* and sampling. The engine calls, in order:
``load()`` once, ``init_kv_cache()`` once, then ``step()`` per engine iteration, ``release()``
when sequences leave, and ``close()`` at shutdown. All calls come from the engine thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from llmserve.config import ServerConfig
from llmserve.request import LogitsMask
from llmserve.sampling import SamplingParams

#: What a model takes as input unless its backend says more (``ModelInfo.input_modalities``).
TEXT_ONLY: tuple[str, ...] = ("text",)


@dataclass(slots=True)
class ModelInfo:
    """What the engine and the dialects need to know about the loaded model."""

    name: str                       # what to show as the model id by default
    path: str                       # where the weights came from
    max_model_len: int              # context length the server will enforce
    vocab_size: int                 # rows of the logits (may exceed len(tokenizer))
    eos_token_ids: list[int]
    tokenizer: Any                  # a transformers PreTrainedTokenizerBase
    chat_template: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    task: str = "generate"          # "generate" or "embed"
    quantization: str | None = None  # how the weights are stored when not plainly in ``dtype``
    num_parameters: int | None = None  # weights in the model, when the backend knows without a directory to read
    weight_bytes: int | None = None    # bytes its weights take as served (e.g. a GGUF's quantized tensors)
    # What requests may send it, as served (``/v1/models`` reports it): a backend that serves a
    # vision model's images says ("text", "image") and sets ``media``.
    input_modalities: tuple[str, ...] = TEXT_ONLY
    # How prompts' images become the model's input (``llmserve.media.inputs.MediaProcessor``).
    media: Any = None
    # Bytes of one sequence's recurrent state, for a hybrid model whose layers keep a fixed-size
    # state per sequence (linear attention, convolution, SSM) beside or instead of keys and values;
    # non-zero: the engine asks for a state slot per running sequence (``KVCacheSpec.state_slots``)
    # and saved states for the prefix cache (``state_snapshots``), and feeds each sequence's slot.
    state_bytes: int = 0

    def __post_init__(self) -> None:
        # A model is refused at load when its own chat template is a template-injection
        # payload (the sandbox would stop it per request; serving it at all is the mistake).
        from llmserve.text.sandbox import refuse_injected_templates

        refuse_injected_templates(self.name, [self.chat_template, getattr(self.tokenizer, "chat_template", None)])


@dataclass(slots=True)
class KVCacheSpec:
    """How the engine wants the KV pool sized.

    Exactly one of ``num_blocks`` or ``memory_fraction`` decides the size; the backend reports
    how many blocks it actually allocated. ``min_blocks`` is what one max-length request
    needs: the engine refuses to start with fewer (one check for every backend), so a
    backend need not repeat it; it may use the number to size a pool.
    ``state_slots`` (a model with ``ModelInfo.state_bytes``): how many sequences' recurrent
    states to allocate beside the blocks, slots ``0 .. state_slots - 1``, inside the same memory
    (``memory_fraction`` covers both; with ``num_blocks`` the states come on top), and
    ``state_snapshots`` saved states (``StepItem.state_snapshot``, ``state_restore``) in the same way.
    """

    block_size: int
    num_blocks: int | None = None
    memory_fraction: float | None = None
    min_blocks: int = 1
    state_slots: int = 0
    state_snapshots: int = 0


@dataclass(slots=True)
class StepItem:
    """One sequence's work in a step.

    ``token_ids`` are fed at positions ``start_pos .. start_pos + len(token_ids) - 1``: a chunk
    of the prompt (prefill, possibly one of several chunks) or the single newest token
    (decode). Their KV goes into ``block_table`` (physical block ids; slot of position p is
    ``block_table[p // block_size] * block_size + p % block_size``). Positions before
    ``start_pos`` are already in the cache.

    When ``sample`` is True the backend samples one new token from the logits of the last
    fed position (only among ``sampling.allowed_token_ids`` when set), using ``sampling``,
    ``prompt_ids``/``output_ids`` (penalties, min_tokens), ``seed_offset`` (a per-sequence
    seed is ``sampling.seed + seed_offset``) and ``mask``.
    ``prompt_logprob_targets`` (when not None) are the tokens at positions
    ``start_pos + 1 ...``: the backend returns their log-probabilities from the logits of
    the fed positions (one fewer than fed on the last prompt chunk).
    The last ``num_draft_tokens`` fed tokens are proposals to verify (speculative decoding; only
    for a backend whose ``verifies_drafts`` is True): the backend then samples at each of the
    last ``num_draft_tokens + 1`` positions, each as if the proposals before it had been output
    (``output_ids`` extended by them, for penalties and ``min_tokens``), and returns the first
    sample as usual and the others in ``StepResult.draft_samples``.
    ``media`` are the prompt's images whose expansion starts at or before the last fed position
    (``llmserve.media.inputs.MediaInput``, made by the backend's own ``ModelInfo.media``): the
    backend feeds the embeddings of those the fed positions meet at their placeholders' positions
    instead of the tokens'; the earlier ones are there for a model whose positions they move
    (a multimodal RoPE).
    ``state_slot`` (a hybrid model, ``KVCacheSpec.state_slots``): the slot holding the sequence's
    recurrent state, read before and written after the fed tokens; the state starts empty when
    ``start_pos`` is 0 (-1: the model keeps none). ``state_restore`` (not -1): first copy saved
    state ``state_restore`` into the slot (a prefix-cache hit resumes there); ``state_snapshot``
    ``(tokens, snapshot)``: save the state as it is after the sequence's first ``tokens`` tokens
    (a position inside or at the end of the fed ones) into saved state ``snapshot``.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True
    sampling: SamplingParams | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    seed_offset: int = 0
    mask: LogitsMask | None = None
    prompt_logprob_targets: list[int] | None = None
    num_draft_tokens: int = 0
    media: tuple[Any, ...] = ()
    state_slot: int = -1
    state_restore: int = -1
    state_snapshot: tuple[int, int] | None = None


@dataclass(slots=True)
class StepResult:
    """What the backend returns for one StepItem (same order as the batch).

    ``token_id`` is None when the item did not sample. ``logprob`` is the sampled token's
    log-probability (raw log-softmax unless ``sampling.logprobs_mode == "processed"``) and
    ``top`` its ``sampling.logprobs`` best alternatives (or, with ``sampling.logprob_token_ids``,
    those tokens' logprobs in that order). ``prompt_logprobs`` holds, per target,
    ``(logprob, top alternatives)``; ``prompt_ranks`` (optional) each target's rank in its
    distribution (1 = most likely, ties counted). ``draft_samples``: for an item with
    ``num_draft_tokens``, the samples at the positions of its proposals, in order (each with its
    own ``token_id``, ``logprob`` and ``top``).
    """

    seq_id: int
    token_id: int | None = None
    logprob: float = 0.0
    top: list[tuple[int, float]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_ranks: list[int] | None = None
    draft_samples: list["StepResult"] | None = None


class Backend(ABC):
    """A model runner. Contributed by plugins through ``register_backends``.

    Example::

        class EchoBackend(Backend):
            def __init__(self, config):
                self.config = config
            def load(self):
                return ModelInfo(name="echo", path="", max_model_len=512, vocab_size=256,
                                 eos_token_ids=[0], tokenizer=ByteTokenizer())
            def init_kv_cache(self, spec):
                return spec.num_blocks or 64
            def step(self, batch):
                return [StepResult(i.seq_id, token_id=i.token_ids[-1]) if i.sample
                        else StepResult(i.seq_id) for i in batch]
    """

    #: Whether ``step`` verifies proposed tokens (``StepItem.num_draft_tokens``); speculative
    #: decoding is refused at start for a backend that does not.
    verifies_drafts: bool = False

    def __init__(self, config: ServerConfig) -> None:
        self.config = config  # its sections: config.llm (the model), config.cache, config.scheduler, ...

    @abstractmethod
    def load(self) -> ModelInfo:
        """Load weights and tokenizer; log progress for anything slow."""

    @abstractmethod
    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        """Allocate the KV pool as ``spec`` asks and return the number of blocks allocated."""

    @abstractmethod
    def step(self, batch: list[StepItem]) -> list[StepResult]:
        """Run one batched forward over every item and sample where asked. Blocking."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget per-sequence state (random generators, caches) of finished sequences."""
        return None  # optional: a backend without per-sequence state has nothing to forget

    def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Pooled embeddings for an embedding model (task "embed"); one vector per input."""
        from llmserve.errors import InvalidRequestError

        raise InvalidRequestError(f"the {type(self).__name__} backend does not compute embeddings")

    def close(self) -> None:
        """Free device memory; called once at shutdown."""
        return None  # optional: nothing to free by default
