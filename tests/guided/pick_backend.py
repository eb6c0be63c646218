"""A test plugin: the ``pick`` backend, a byte-level "model" that honours logits masks.

Each sampled token is drawn (seeded per sequence) from what the sequence's mask allows, with
a lean towards tokens that close strings, arrays and objects so constrained output ends, and
end-of-sequence as soon as the mask allows it. Without a mask it ends at once. Used to test
guided decoding through the HTTP server without a real model.
"""

from __future__ import annotations

import random

from llmserve import hookimpl
from llmserve.hooks.records import BackendSpec
from llmserve.engine.backend import Backend, KVCacheSpec, ModelInfo, StepItem, StepResult

EOS = 256
CLOSERS = frozenset(b'"}],')


class ByteTokenizer:
    """UTF-8 bytes as token ids; 256 is end-of-sequence."""

    eos_token_id = EOS
    bos_token_id = None
    chat_template = None
    all_special_ids = [EOS]

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) if i < 256 else "</s>" for i in ids]


class PickBackend(Backend):
    def load(self) -> ModelInfo:
        return ModelInfo(name="pick", path="pick://", max_model_len=2048, vocab_size=257,
                         eos_token_ids=[EOS], tokenizer=ByteTokenizer())

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        return spec.num_blocks or max(spec.min_blocks * 4, 64)

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        out = []
        for item in batch:
            if not item.sample:
                out.append(StepResult(item.seq_id))
                continue
            allowed = item.mask.allowed(item.output_ids) if item.mask is not None else [EOS]
            seed = ((item.sampling.seed if item.sampling and item.sampling.seed is not None else 0)
                    + item.seed_offset) * 100003 + len(item.output_ids)
            rng = random.Random(seed)
            rest = [t for t in allowed if t != EOS]
            if EOS in allowed and (not rest or rng.random() < 0.5):
                token = EOS
            else:
                closers = [t for t in rest if t in CLOSERS] if rng.random() < 0.5 else []
                token = rng.choice(closers or rest)
            out.append(StepResult(item.seq_id, token_id=token, logprob=-1.0))
        return out


@hookimpl
def register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="pick", target=f"{__name__}:PickBackend",
                        description="test backend: random tokens among those the mask allows")]
