"""The torch backend on the real embedded SmolLM2-135M: greedy batched decoding equals HF generate."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime, step by step, in plain words.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
NEW_TOKENS = 20
BS = 16


@pytest.fixture(scope="module")
def backend():
    from llmserve.plugins.backends.torch.loader import embedded_model_path
    from llmserve.plugins.backends.torch.runner import TorchBackend

    try:
        embedded_model_path()
    except Exception as exc:  # noqa: BLE001 - the wheel is optional
        pytest.skip(str(exc))
    # Default cache dir (~/.cache/llmserve): the first run converts the GGUF (~20 s), later runs reuse it.
    b = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu"))
    info = b.load()
    b.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=64))
    yield b, info
    b.close()


def test_model_info(backend) -> None:
    _, info = backend
    assert info.name == "SmolLM2-135M-Instruct" and info.max_model_len == 8192
    assert 2 in info.eos_token_ids and info.vocab_size == 49152 and info.chat_template


def test_greedy_batch_equals_generate(backend) -> None:
    b, info = backend
    tok = info.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    # The reference: a second load, untouched by the fused forward and the packed kernels (which
    # take the weights out of the served model's transformers layers).
    from engine.test_greedy_equality import batched_greedy
    from llmserve.plugins.backends.torch.options import TorchOptions
    from llmserve.plugins.backends.torch.runner import TorchBackend

    ref = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu"),
                       TorchOptions(fused_forward=False, cpu_kernels=False))
    ref.load()
    model = ref.loaded.model
    model.set_attn_implementation("sdpa")  # plain HF path for the reference
    expected = batched_greedy(model, prompts, info.eos_token_ids[0], list(info.eos_token_ids),
                              max_new_tokens=NEW_TOKENS)
    ref.close()

    greedy = SamplingParams(temperature=0)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    # Step 1: every prompt but the longest prefills at once; the longest only sends its first chunk.
    long_i = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    split = len(prompts[long_i]) // 2
    batch = [StepItem(i, ids if i != long_i else ids[:split], 0, tables[i], sample=i != long_i,
                      sampling=greedy, prompt_ids=ids) for i, ids in enumerate(prompts)]
    pending = {long_i}
    for _ in range(NEW_TOKENS + 1):
        for r in b.step(batch):
            if r.token_id is not None:
                outs[r.seq_id].append(r.token_id)
        batch = []
        for i, ids in enumerate(prompts):
            if i in pending:  # second chunk of the long prompt rides along with the decodes
                batch.append(StepItem(i, ids[split:], split, tables[i], sampling=greedy, prompt_ids=ids))
                pending.discard(i)
            elif outs[i] and len(outs[i]) < NEW_TOKENS and outs[i][-1] not in info.eos_token_ids:
                batch.append(StepItem(i, [outs[i][-1]], len(ids) + len(outs[i]) - 1, tables[i],
                                      sampling=greedy, prompt_ids=ids, output_ids=list(outs[i])))
        if not batch:
            break
    assert outs == expected
