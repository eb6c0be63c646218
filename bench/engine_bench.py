"""Engine benchmark without HTTP: the torch backend under the real scheduler at fixed input and
output lengths, one closed batch per concurrency level.

For each concurrency ``c`` it queues ``c`` requests of ``--input-len`` random prompt tokens and
``--output-len`` greedy output tokens (EOS ignored), steps the engine until all finish, and
reports output tokens/s over the whole run, wall milliseconds per decode-only step (median),
the share of steps replayed from a CUDA graph, and the step's physical floor: the bytes a decode
step must read (every weight once, plus each row's KV) over the memory bandwidth, and its
arithmetic (2 FLOP per weight per row) over the peak matrix throughput, with the ratio of that
floor to the measured step. Ceilings are measured in-process on CUDA (a device copy and a bf16
matrix product) unless given; on the CPU pass them (``--bandwidth-gbs``, ``--tflops``) or the
ratios are left out. Runs on the CPU too (any model the torch backend serves).

    python bench/engine_bench.py --model /tmp/m-1b --dtype bfloat16 --device cuda --concurrency 1 32 128
    python bench/engine_bench.py --concurrency 1 8 --output-len 32            # embedded SmolLM2 on the CPU
"""

from __future__ import annotations

import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import bench_args  # bench/bench_args.py (bench/ is this script's folder, first on sys.path)
from device.report import append_jsonl  # bench/device/report.py
from llmserve.config import ServerConfig
from llmserve.engine.engine import LLMEngine
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.request import PreparedRequest
from llmserve.sampling import SamplingParams


def ceilings(device: str) -> tuple[float | None, float | None]:
    """Measured device-to-device copy bandwidth (GB/s, bytes read + written) and bf16 matrix
    TFLOP/s on CUDA; (None, None) elsewhere."""
    if device != "cuda":
        return None, None
    x = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        y.copy_(x), a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 10 * 2 * x.numel() * 2 / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    tflops = 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12
    del x, y, a
    torch.cuda.empty_cache()
    return bw, tflops


def model_bytes(backend: TorchBackend) -> tuple[int, int, int]:
    """(bytes of weights one decode step reads, parameters multiplied per row, KV bytes per token)."""
    cache = backend.cache
    kv = backend._num_layers * 2 * cache.kv_heads * cache.head_dim * cache.pool.element_size()
    if backend._gguf is not None:  # a GGUF served in its own quantization: the file's own figures
        return backend._gguf.weight_bytes, backend._gguf.parameters, kv
    model = backend.loaded.model
    seen, total, params = set(), 0, 0
    embed = model.get_input_embeddings().weight
    for p in model.parameters():
        if p.data_ptr() in seen or p.numel() == 0:
            continue
        seen.add(p.data_ptr())
        if p is embed and model.get_output_embeddings().weight is not embed:
            total += p.shape[1] * p.element_size()  # an untied embedding: one row per token is read
            continue
        total += p.numel() * p.element_size()
        params += p.numel()
    return total, params, kv


def run_level(engine: LLMEngine, backend: TorchBackend, c: int, input_len: int, output_len: int,
              vocab: int, rng: random.Random) -> dict:
    done: list[str] = []

    def sink(out) -> None:
        if out.finished:
            done.append(out.request_id)

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(c):
        ids = [rng.randrange(10, vocab) for _ in range(input_len)]
        engine.add_request(PreparedRequest(f"r{c}-{i}", None, tuple(ids), sp), sink)
    sync = torch.cuda.synchronize if backend.loaded.device.type == "cuda" else (lambda: None)
    graphs = backend._graphs
    replayed0, steps0 = (graphs.replayed if graphs else 0), backend.steps
    decode_ms: list[float] = []
    sync()
    start = time.perf_counter()
    while len(done) < c:
        t = time.perf_counter()
        engine.step()
        sync()
        if backend.last_step_decoded:
            decode_ms.append((time.perf_counter() - t) * 1e3)
    wall = time.perf_counter() - start
    steps = backend.steps - steps0
    return {"concurrency": c, "tok_s": c * output_len / wall, "wall_s": wall, "steps": steps,
            "decode_step_ms": statistics.median(decode_ms) if decode_ms else None,
            "graphed_pct": 100.0 * ((graphs.replayed if graphs else 0) - replayed0) / max(1, steps)}


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    bench_args.add_model(ap)
    bench_args.add_levels(ap, rounds=False)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth ceiling (default: measured)")
    ap.add_argument("--tflops", type=float, default=None, help="matrix throughput ceiling (default: measured)")
    ap.add_argument("--json", default=None, help="append one JSON line per level to this file")
    ap.add_argument("--label", default="", help="a name for this run in the JSON lines")
    args = ap.parse_args()

    bw, tflops = ceilings(args.device)
    bw, tflops = args.bandwidth_gbs or bw, args.tflops or tflops
    max_seqs = max(args.concurrency)
    config = ServerConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                             max_num_seqs=max_seqs, enforce_eager=args.enforce_eager, block_size=16,
                             max_num_batched_tokens=max(2048, args.input_len * 4), num_kv_blocks=None,
                             kv_cache_memory_fraction=0.3)
    started = time.perf_counter()
    backend = TorchBackend(config, TorchOptions.from_environ())
    info = backend.load()
    engine = LLMEngine(backend, info, config)
    real_step = backend.step

    def step(items):  # notes whether a step fed only decode rows (the steps timed per step)
        backend.last_step_decoded = all(len(it.token_ids) == 1 for it in items)
        return real_step(items)

    backend.step = step
    ready = time.perf_counter() - started
    weights, params, kv_token = model_bytes(backend)
    print(f"ready in {ready:.1f} s; plan: {backend.plan()}")
    print(f"weights read per step {weights / 1e9:.3f} GB, {params / 1e9:.3f} B parameters, KV {kv_token} B/token"
          + (f"; ceilings {bw:.3g} GB/s, {tflops:.3g} TFLOP/s" if bw and tflops else ""))
    rng = random.Random(0)
    run_level(engine, backend, 2, 16, 4, info.vocab_size, rng)  # warm-up (kernels, allocator)
    print(f"{'c':>4} {'tok/s':>10} {'ms/step':>8} {'graphed':>8} {'floor ms':>9} {'of floor':>9} {'bound':>8}")
    for c in args.concurrency:
        r = run_level(engine, backend, c, args.input_len, args.output_len, info.vocab_size, rng)
        ctx = args.input_len + args.output_len / 2  # the mean context over the decode steps
        r["floor_ms"] = r["bound"] = None
        if bw and tflops:
            mem_ms = (weights + c * ctx * kv_token) / (bw * 1e9) * 1e3
            flop_ms = 2 * params * c / (tflops * 1e12) * 1e3
            r["floor_ms"], r["bound"] = max(mem_ms, flop_ms), "memory" if mem_ms >= flop_ms else "compute"
        r.update(section="engine", label=args.label, ready_s=ready, bandwidth_gbs=bw, tflops=tflops,
                 plan=backend.plan())
        step = r["decode_step_ms"]
        of = f"{100 * r['floor_ms'] / step:.0f}%" if r["floor_ms"] and step else "-"
        print(f"{c:>4} {r['tok_s']:>10.1f} {step or 0:>8.2f} {r['graphed_pct']:>7.0f}% "
              f"{r['floor_ms'] or 0:>9.3f} {of:>9} {r['bound'] or '-':>8}")
        append_jsonl(args.json, r)


if __name__ == "__main__":
    main()
