"""Acceptance: two ranks (gloo, CPU) generate exactly what one rank does on the embedded SmolLM2.

fp32, greedy, 20 prompts in one batch, prefix caching on (a second pass of the long prompts
reuses the first's blocks) and chunked prefill splitting the long prompts. SmolLM2's 9 heads in 3 KV heads split
unevenly (6 + 3 heads); the all-reduce sums the halves in another order than one matmul does,
so a difference would show up first at a near-tie: none is tolerated here.
"""

from __future__ import annotations

import pytest

from llmserve.config import ServerConfig

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # two loads of the model, one of them in 2 processes

MAX_NEW = 16
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
    "List three primary colors:", "Water boils at", "The quick brown fox", "In 1969, astronauts",
    "A haiku about autumn:\n", "Translate to French: Good morning, how are you?", "The mitochondria is",
    "1, 2, 3, 4,", "Q: What is 12 times 12?\nA:", "import numpy as np\n\nx =", "The best way to learn a language is",
    "Dear hiring manager,", "Photosynthesis converts", "Rain is falling on the", "Recipe: pancakes. Ingredients:",
    "Here is a long passage about the history of computing. " * 12 + "In summary,",
    "Notes from the meeting: " + "the team discussed budgets, timelines and hiring. " * 10 + "Next steps:",
]


def generate(tp: int, passes: int) -> tuple[list[dict[str, list[int]]], int]:
    """Greedy tokens per prompt of each pass (a second pass runs the two long prompts again, from
    the blocks the first cached) and the prefix-cache hits."""
    from llmserve.engine.engine import LLMEngine
    from llmserve.plugins.backends.torch.factory import create
    from llmserve.plugins.backends.torch.options import TorchOptions
    from llmserve.request import PreparedRequest
    from llmserve.sampling import SamplingParams

    backend = create(ServerConfig(model=None, dtype="float32", device="cpu", max_model_len=1024,
                                  tensor_parallel_size=tp, log_level="warning"), TorchOptions())
    try:
        info = backend.load()
        config = ServerConfig(block_size=16, num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=128,
                              enable_prefix_caching=True, enable_chunked_prefill=True)
        engine = LLMEngine(backend, info, config)
        runs = []
        for n in range(passes):
            results: dict[str, list[int]] = {}
            for p in PROMPTS if n == 0 else PROMPTS[-2:]:
                req = PreparedRequest(prompt=p, prompt_token_ids=tuple(engine.tokenizer(p).input_ids),
                                      request_id=f"{n}:{p}",
                                      sampling=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
                engine.add_request(req, lambda out, p=p, r=results: r.setdefault(
                    p, []).extend(t for d in out.outputs for t in d.token_ids))
            while engine.has_work:
                engine.step()
            assert engine.check_idle()
            runs.append(results)
        return runs, engine.block_manager.prefix_hit_tokens
    finally:
        backend.close()


def test_two_ranks_generate_what_one_does():
    (one,), _ = generate(1, 1)
    runs, prefix_hits = generate(2, 2)
    assert prefix_hits >= 2 * 16 * 5  # the second pass read the long prompts' blocks the first cached
    assert all(len(t) == MAX_NEW for t in one.values()) and len(one) == len(PROMPTS)
    assert len(runs[0]) == len(PROMPTS) and len(runs[1]) == 2
    for results in runs:
        differ = {p: next(i for i, (a, b) in enumerate(zip(results[p], one[p])) if a != b)
                  for p in results if results[p] != one[p]}
        assert differ == {}, f"prompts that diverge (at token): {differ}"
