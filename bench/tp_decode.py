"""Decode speed of tensor parallel against one rank, and the time its collectives take per step.

Loads the model twice in this process (``--tensor-parallel-size 1``, and N with its workers),
then alternates rounds, so every run sees the same machine load: one rank on every core, one
rank on rank 0's share of the cores, and N ranks. Each round prefills ``--batch`` prompts of
``--prompt`` tokens and times ``--steps`` batched greedy decode steps. Prints the median tokens
per second of each, and for N ranks the milliseconds per step rank 0 spent in its all-reduces
and the logits gather (waiting for the slower rank included). The native kernels are built
first, so no compiler runs while it measures.

    python bench/tp_decode.py --tp 2 --batch 8 --steps 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def load(model: str | None, tp: int, batch: int, per_seq: int) -> Any:
    from llmserve.config import ServerConfig
    from llmserve.engine.backend import KVCacheSpec
    from llmserve.plugins.backends.torch.factory import create
    from llmserve.plugins.backends.torch.options import TorchOptions

    backend = create(ServerConfig(model=model, dtype="float32", device="cpu", max_model_len=None,
                                  tensor_parallel_size=tp, log_level="warning"), TorchOptions())
    backend.load()
    backend.init_kv_cache(KVCacheSpec(16, num_blocks=batch * per_seq))
    return backend


def round_(backend: Any, batch: int, prompt: int, steps: int, per_seq: int) -> tuple[float, float]:
    """(decode tokens per second, collective ms per step) of one prefill + ``steps`` decode steps."""
    from llmserve.engine.backend import StepItem
    from llmserve.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from llmserve.plugins.backends.torch.native.build import build_all

    build_all()
    import os

    import torch

    from llmserve.plugins.backends.torch.tensor_parallel import _pin, rank_cores

    cores = sorted(os.sched_getaffinity(0))
    mine = rank_cores(args.tp, 0, cores)
    # Rank 0 pins this whole process to its share of the cores: each round sets the cores and
    # threads of what it measures. One rank runs twice: on every core, and on rank 0's share
    # with as many threads (what tensor parallel gives each of its ranks).
    runs = {f"tensor_parallel=1, {len(cores)} threads": (1, cores, len(cores)),
            f"tensor_parallel=1, {len(mine)} threads": (1, mine, len(mine)),
            f"tensor_parallel={args.tp}, {len(mine)} threads per rank": (args.tp, mine, len(mine))}
    per_seq = -(-(args.prompt + args.steps + 1) // 16)
    backends = {tp: load(args.model, tp, args.batch, per_seq) for tp in (1, args.tp)}
    rates: dict[str, list[float]] = {label: [] for label in runs}
    collective: list[float] = []
    try:
        for _ in range(args.rounds):
            for label, (tp, use, threads) in runs.items():
                _pin(use)
                torch.set_num_threads(threads)
                tok_s, reduce_ms = round_(backends[tp], args.batch, args.prompt, args.steps, per_seq)
                rates[label].append(tok_s)
                if tp > 1:
                    collective.append(reduce_ms)
    finally:
        for backend in backends.values():
            backend.close()
    for label, values in rates.items():
        extra = f", collectives {statistics.median(collective):.2f} ms/step on rank 0" if "per rank" in label else ""
        print(f"{label}: {statistics.median(values):.1f} decode tok/s (batch {args.batch}, median of "
              f"{args.rounds} rounds: {', '.join(f'{v:.0f}' for v in values)}){extra}", flush=True)


if __name__ == "__main__":
    main()
