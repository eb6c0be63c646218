"""The in-run peer: transformers' ``generate`` with a static cache (its decode step compiled
with CUDA graphs), greedy, 128 new tokens, at the batch sizes given.

    python bench/device/hf_compiled.py MODEL_DIR --batch 1 32 128 [--json FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM
from report import append_jsonl  # bench/device/report.py

NEW = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    for bs in args.batch:
        ids = torch.randint(10, model.config.vocab_size, (bs, args.input_len), device="cuda")
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids))
        for _ in range(2):  # compiles, then warms the graphs
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        row = {"section": "hf_compiled", "batch": bs, "tok_s": bs * NEW / dt, "ms_per_step": dt / NEW * 1e3}
        print(f"transformers generate, static cache, compiled: batch {bs}: {row['tok_s']:.0f} tok/s "
              f"({row['ms_per_step']:.2f} ms per step, prefill included)")
        append_jsonl(args.json, row)


if __name__ == "__main__":
    main()
