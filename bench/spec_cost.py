"""What speculative decoding can gain here: the cost of one model pass over k + 1 tokens of one
sequence (its newest token and k proposals), k = 0..8, and from it the speed-up an acceptance
rate allows.

One backend per model (the server's defaults: native GGUF kernels, the fused forward), a
context of ``--context`` tokens prefilled once, then for each k the same step repeated
(``--reps`` times, k interleaved so that machine noise hits all alike): the step feeds the
newest token and k proposals after the context and samples at each of their positions, as a
verifying step does. k = 0 is a plain decode step (the one-call native step where it applies).

With each proposal accepted with probability a (independently), a pass of k proposals emits
(1 - a^(k+1)) / (1 - a) tokens; the speed-up over plain decoding is that over t(k) / t(0).
The table gives the best k and its speed-up for a few rates.

    python bench/spec_cost.py                                   # the embedded SmolLM2-135M
    python bench/spec_cost.py --model ~/.cache/llmserve/bench-models/llama-1b-shape-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.sampling import SamplingParams

BLOCK = 16


def emitted(a: float, k: int) -> float:
    """Expected tokens a pass with k proposals emits at acceptance rate a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def measure(model: str | None, context: int, ks: list[int], reps: int) -> dict[int, float]:
    backend = TorchBackend(ServerConfig(model=model, device="cpu", max_model_len=context + 64))
    info = backend.load()
    blocks = (context + 64) // BLOCK + 2
    backend.init_kv_cache(KVCacheSpec(block_size=BLOCK, num_blocks=blocks))
    rng = random.Random(0)
    ids = [rng.randrange(100, min(info.vocab_size, 30000)) for _ in range(context + 16)]
    table = list(range(blocks))
    greedy = SamplingParams(temperature=0)
    for start in range(0, context, 512):  # the context, in prefill chunks
        chunk = ids[start:min(start + 512, context)]
        backend.step([StepItem(0, chunk, start, table, sample=start + 512 >= context, sampling=greedy,
                               prompt_ids=ids[:context])])
    times: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(reps + 2):  # two warm-up rounds
        for k in ks:
            item = StepItem(0, ids[context:context + 1 + k], context, table, sampling=greedy,
                            prompt_ids=ids[:context], output_ids=[ids[context]], num_draft_tokens=k)
            t0 = time.perf_counter()
            backend.step([item])
            if rep >= 2:
                times[k].append(time.perf_counter() - t0)
    print(f"# {info.name}: plan {backend.plan()}")
    backend.close()
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ks = list(range(args.max_k + 1))
    ms = measure(args.model, args.context, ks, args.reps)
    print("| k | pass ms | vs k=0 |")
    print("|---|---|---|")
    for k in ks:
        print(f"| {k} | {ms[k]:.1f} | {ms[k] / ms[0]:.2f}x |")
    print()
    print("| acceptance | best k | speed-up |")
    print("|---|---|---|")
    for a in (0.3, 0.5, 0.7, 0.8, 0.9):
        best = max(ks, key=lambda k: emitted(a, k) * ms[0] / ms[k])
        print(f"| {a:.1f} | {best} | {emitted(a, best) * ms[0] / ms[best]:.2f}x |")


if __name__ == "__main__":
    main()
