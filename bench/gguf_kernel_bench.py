"""GGUF linear kernel micro-benchmark: the exact fp32 path vs the int8-activation path, decode-sized.

For each weight type (random valid blocks: random codes, small fp16 scales), each weight shape
[N, K], each thread count and each number of rows of x (M, decode steps and small batches), both
``GGUFLinear`` kernels of ``plugins/backends/torch/native/gguf_ops.py`` (``gguf_linear(parts)``
and ``gguf_linear(parts, int8=True)``) are called through their C entry point (``kernel``, the
pointer the one-call decode step uses; no Python wrapper in the timing), repetitions interleaved
between the two so that machine noise hits both alike. The table gives the median microseconds
per call, the weight bytes read per second (GB/s: the quantized matrix's bytes over the median
time; at these sizes the weights may sit in the last-level cache) and the speedup of int8.

    python bench/gguf_kernel_bench.py
    python bench/gguf_kernel_bench.py --types Q4_K --shapes 4096x4096 --rows 1 --threads 1 2 --reps 200
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmserve.plugins.backends.torch.native import gguf_ops

# Byte offsets of the fp16 scales in each type's block (set to small finite values).
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,)}
KERNEL = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_int)


def weights(qtype: str, n: int, k: int, rng: np.random.Generator) -> gguf_ops.QuantTensor:
    t = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        raw[:, off:off + 2] = (rng.uniform(0.002, 0.006, raw.shape[0]).astype(np.float16)
                               .view(np.uint8).reshape(-1, 2))
    return gguf_ops.QuantTensor(int(t), torch.from_numpy(raw.reshape(n, -1)), (n, k))


def time_pair(lins: list[gguf_ops.GGUFLinear], m: int, threads: int, reps: int) -> list[float]:
    """Median microseconds per call of each linear, repetitions interleaved."""
    n, k = lins[0].out_features, lins[0].in_features
    x, y = torch.randn(m, k), torch.empty(m, n)
    fns = [KERNEL(lin.kernel) for lin in lins]
    times: list[list[float]] = [[] for _ in lins]
    for rep in range(reps + 3):  # three warm-up calls each
        for i, (fn, lin) in enumerate(zip(fns, lins)):
            t0 = time.perf_counter_ns()
            fn(x.data_ptr(), lin.packed.data_ptr(), None, y.data_ptr(), m, n, k, threads)
            if rep >= 3:
                times[i].append((time.perf_counter_ns() - t0) / 1e3)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"], choices=sorted(SCALES))
    ap.add_argument("--shapes", nargs="+", default=["2048x2048", "8192x2048"], help="NxK (outputs x inputs)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="rows of x (M)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=50, help="timed calls per kernel and configuration")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    head = f"| {'type':5} | {'N x K':10} | thr | {'M':>2} | exact us | int8 us | exact GB/s | int8 GB/s | speedup |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for qtype in args.types:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.lower().split("x"))
            q = weights(qtype, n, k, rng)
            lins = [gguf_ops.gguf_linear([q]), gguf_ops.gguf_linear([q], int8=True)]
            if lins[0] is None or lins[1] is None:
                raise SystemExit("the native GGUF kernel library cannot be built here")
            nbytes = q.data.numel()
            for threads in args.threads:
                for m in args.rows:
                    exact, int8 = time_pair(lins, m, threads, args.reps)
                    print(f"| {qtype:5} | {shape:10} | {threads:3} | {m:2} | {exact:8.1f} | {int8:7.1f} | "
                          f"{nbytes / exact / 1e3:10.1f} | {nbytes / int8 / 1e3:9.1f} | {exact / int8:6.2f}x |")


if __name__ == "__main__":
    main()
