"""Engine-step micro-benchmark: time (and optionally profile) the torch backend's batched step.

Loads the model straight into ``TorchBackend`` (no server, no scheduler), prefills ``--batch``
sequences of ``--context`` tokens, then times decode steps of the whole batch, the unit of
work that decides throughput at high concurrency. ``--profile`` prints torch profiler's table
of the most expensive operators for a few of those steps.

    python bench/step_bench.py --batch 32 --context 200
    python bench/step_bench.py --batch 1 --context 50 --profile
    python bench/step_bench.py --batch 32 --context 90 --parts

``--parts`` wraps the step's pieces (packed linears, attention, the decode kernel, norms,
sampling...) in wall-clock timers and prints where a step goes; unlike a sampling profiler it
barely perturbs the OpenMP threads, whose barriers a profiler's pauses stretch. Its parts are
Python calls, so it runs decode steps through the fused forward's Python layer loop; the
default is the one-call native step (``native/step.py``), and ``--layer-loop`` times the loop
without the timers, for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.sampling import SamplingParams


class PartTimers:
    """Wall-clock totals of wrapped callables (nested parts count in both)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def patch(self, owner: object, attr: str, name: str) -> None:
        setattr(owner, attr, self.wrap(name, getattr(owner, attr)))


def report_parts(backend: TorchBackend, step, steps: int) -> None:
    from llmserve.plugins.backends.torch import fused, fused_hybrid, runner
    from llmserve.plugins.backends.torch.native import gguf_ops, ops

    timers = PartTimers()
    timers.patch(ops.PackedLinear, "__call__", "linear (packed)")
    timers.patch(fused._TorchLinear, "__call__", "linear (torch)")
    timers.patch(gguf_ops.GGUFLinear, "__call__", "linear (GGUF)")
    timers.patch(fused_hybrid, "paged_attention", "attention (KV write + kernel)")
    timers.patch(fused_hybrid, "mix", "recurrent mixing (Gated DeltaNet)")
    timers.patch(fused_hybrid, "short_conv", "recurrent mixing (short convolution)")
    timers.patch(fused_hybrid.HybridDecoder, "forward", "fused forward")
    timers.patch(runner.TorchBackend, "_forward", "step inputs + forward")
    for op in ("add_rms_norm", "silu_mul", "rope"):
        for cls in (ops.ElementwiseOps, fused.TorchOps):
            timers.patch(cls, op, op)
    timers.patch(fused, "paged_attention", "attention (KV write + kernel)")
    if backend.cache is not None and backend.cache.decode_kernel is not None:
        timers.patch(backend.cache, "decode_kernel", "  decode kernel")
    timers.patch(runner.TorchBackend, "_logits", "lm_head")
    timers.patch(backend.sampler, "sample", "sampling")
    timers.patch(fused.FusedDecoder, "forward", "fused forward")
    wall = sum(step() for _ in range(steps))
    print(f"parts over {steps} steps ({wall / steps * 1e3:.1f} ms per step):")
    for name, t in sorted(timers.total.items(), key=lambda kv: -kv[1]):
        calls = timers.calls[name] // steps
        print(f"  {name:32s} {t / steps * 1e3:7.2f} ms/step  {t / wall * 100:5.1f}%  ({calls} calls)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=200, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="print torch profiler's operator table")
    ap.add_argument("--parts", action="store_true",
                    help="print wall time per part of a step (runs the Python layer loop, whose parts can be timed)")
    ap.add_argument("--layer-loop", action="store_true",
                    help="decode through the fused forward's Python layer loop, not the one-call native step")
    args = ap.parse_args()

    backend = TorchBackend(ServerConfig(model=args.model, dtype=args.dtype, device=args.device))
    info = backend.load()
    if backend._fused is not None and (args.layer_loop or args.parts):
        backend._fused.native_decode = False
    bs = args.block_size
    per_seq = -(-(args.context + args.steps * 2 + 8) // bs)
    hybrid = bool(info.state_bytes)  # a recurrent state per sequence: one slot each
    backend.init_kv_cache(KVCacheSpec(block_size=bs, num_blocks=per_seq * args.batch,
                                      state_slots=args.batch if hybrid else 0))
    slot = (lambda i: i) if hybrid else (lambda i: None)
    greedy = SamplingParams(temperature=0.0, max_tokens=10_000)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]
    prompts = [torch.randint(100, info.vocab_size - 100, (args.context,), generator=gen).tolist()
               for _ in range(args.batch)]
    t0 = time.perf_counter()
    for i in range(args.batch):  # prefill one by one (not what is measured)
        backend.step([StepItem(seq_id=i, token_ids=prompts[i], start_pos=0, block_table=tables[i], sampling=greedy,
                               state_slot=slot(i))])
    print(f"prefill {args.batch} x {args.context} tokens: {time.perf_counter() - t0:.2f} s")
    last = [p[-1] for p in prompts]
    pos = [args.context] * args.batch

    def step() -> float:
        items = [StepItem(seq_id=i, token_ids=[last[i]], start_pos=pos[i], block_table=tables[i], sampling=greedy,
                          state_slot=slot(i)) for i in range(args.batch)]
        s = time.perf_counter()
        out = backend.step(items)
        dt = time.perf_counter() - s
        for i, r in enumerate(out):
            last[i], pos[i] = r.token_id, pos[i] + 1
        return dt

    for _ in range(3):
        step()
    times = [step() for _ in range(args.steps)]
    med = statistics.median(times)
    print(f"decode step, batch {args.batch}, context ~{args.context}: median {med * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms -> {args.batch / med:.1f} tokens/s")
    if args.parts:
        report_parts(backend, step, args.steps)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
