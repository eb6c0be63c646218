"""A test plugin contributing the ``echo`` backend: it generates the prompt back, then EOS.

Used by serve tests that must not load a real model, and as a proof that a backend can come
from a plugin file given with ``--plugin tests/plugins/echo_backend.py``.
"""

from __future__ import annotations

import os
import time

from llmserve import hookimpl
from llmserve.hooks.records import BackendSpec
from llmserve.engine.backend import Backend, KVCacheSpec, ModelInfo, StepItem, StepResult

EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; 256 is end-of-sequence."""

    eos_token_id = EOS
    bos_token_id = None
    chat_template = None

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and EOS in ids:
            text += "</s>"
        return text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) if i < 256 else "</s>" for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.convert_ids_to_tokens(list(range(257))))}


class EchoBackend(Backend):
    """Keeps a token-level "KV cache" in block slots, so prefix hits and block tables are exercised.

    ``LLMSERVE_ECHO_STEP_DELAY`` (seconds) makes every step that long, like a real model, so
    tests can catch requests while they wait or run; ``LLMSERVE_ECHO_LOAD_DELAY`` (seconds)
    makes the load that long, reported as a progress phase (start-up tests).
    """

    step_delay = 0.0
    verifies_drafts = True

    def load(self) -> ModelInfo:
        self.step_delay = float(os.environ.get("LLMSERVE_ECHO_STEP_DELAY", "0") or 0)
        load_delay = float(os.environ.get("LLMSERVE_ECHO_LOAD_DELAY", "0") or 0)
        if load_delay:  # a slow load, reported the way real loads are (start-up tests)
            from llmserve import progress

            parts = max(1, int(load_delay / 0.05))
            with progress.phase("loading echo weights", total=parts, unit="parts"):
                for _ in range(parts):
                    time.sleep(load_delay / parts)
                    progress.advance()
        return ModelInfo(name="echo", path="echo://",
                         max_model_len=self.config.llm.max_model_len or 512,
                         vocab_size=257, eos_token_ids=[EOS], tokenizer=ByteTokenizer())

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        blocks = spec.num_blocks or max(spec.min_blocks * 4, 64)
        self.block_size = spec.block_size
        self.slots: list[int | None] = [None] * (blocks * spec.block_size)
        return blocks

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        if self.step_delay:
            time.sleep(self.step_delay)
        out = []
        for item in batch:
            for i, tok in enumerate(item.token_ids):
                self.slots[self._slot(item.block_table, item.start_pos + i)] = tok
            prompt_lps = None
            if item.prompt_logprob_targets is not None:
                prompt_lps = [(-1.0, [(t, -1.0)]) for t in item.prompt_logprob_targets]
            if not item.sample:
                out.append(StepResult(item.seq_id, prompt_logprobs=prompt_lps))
                continue
            # One sample per position from the last fed token on: the proposals to verify
            # (num_draft_tokens) are read as if output, as the contract says.
            d = item.num_draft_tokens
            samples = []
            for j in range(d + 1):
                end = item.start_pos + len(item.token_ids) - d + j
                fed = [self.slots[self._slot(item.block_table, p)] for p in range(end)]
                n_out = len(item.output_ids) + j
                token = fed[n_out] if n_out < end - n_out else EOS
                samples.append(StepResult(item.seq_id, token_id=token, logprob=-0.5,
                                          top=[(token, -0.5)] if item.sampling and item.sampling.logprobs else None))
            first = samples[0]
            first.prompt_logprobs, first.draft_samples = prompt_lps, samples[1:] or None
            out.append(first)
        return out


@hookimpl
def register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="echo", target=f"{__name__}:EchoBackend", description="test backend: echoes the prompt")]
