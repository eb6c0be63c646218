"""Decode speed of tensor parallel against one rank, and the time its collectives take per step.

Loads the model twice (``--tensor-parallel-size 1``, then N) with the torch backend directly,
prefills ``--batch`` prompts of ``--prompt`` tokens, then times ``--steps`` batched greedy decode
steps. Prints tokens per second for each, and for N ranks the milliseconds per step rank 0
spent in all-reduces and the logits gather (including the wait for slower ranks).

    python bench/tp_decode.py --tp 2 --batch 8 --steps 32
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace


def run(model: str | None, tp: int, batch: int, prompt: int, steps: int) -> tuple[float, float]:
    from llmserve.engine.backend import KVCacheSpec, StepItem
    from llmserve.plugins.backends.torch.factory import create
    from llmserve.plugins.backends.torch.options import TorchOptions
    from llmserve.sampling import SamplingParams

    backend = create(SimpleNamespace(model=model, dtype="float32", device="cpu", max_model_len=None,
                                     tensor_parallel_size=tp, log_level="warning"), TorchOptions())
    try:
        backend.load()
        bs = 16
        per_seq = -(-(prompt + steps + 1) // bs)
        backend.init_kv_cache(KVCacheSpec(bs, num_blocks=batch * per_seq))
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        greedy = SamplingParams(temperature=0)
        items = [StepItem(i, [(7 * i + j) % 1000 + 10 for j in range(prompt)], 0, tables[i], sampling=greedy)
                 for i in range(batch)]
        last = [r.token_id for r in backend.step(items)]
        reduce0 = getattr(backend, "reduce_s", 0.0)
        t0 = time.perf_counter()
        for s in range(steps):
            items = [StepItem(i, [last[i]], prompt + s, tables[i], sampling=greedy) for i in range(batch)]
            last = [r.token_id for r in backend.step(items)]
        elapsed = time.perf_counter() - t0
        return batch * steps / elapsed, (getattr(backend, "reduce_s", 0.0) - reduce0) / steps * 1000
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    for tp in (1, args.tp):
        tok_s, reduce_ms = run(args.model, tp, args.batch, args.prompt, args.steps)
        extra = f", collectives {reduce_ms:.2f} ms/step on rank 0" if tp > 1 else ""
        print(f"tensor_parallel={tp}: {tok_s:.1f} decode tok/s (batch {args.batch}){extra}", flush=True)


if __name__ == "__main__":
    main()
