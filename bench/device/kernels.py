"""Decode attention on the GPU: the Triton paged kernel (reading the pool in place) against
torch's SDPA over gathered blocks (the path it replaces), at a Llama-3.2-1B layer's shape
(32 query heads, 8 KV heads, head size 64, bf16, 16-token blocks, scattered block ids).

    python bench/device/kernels.py [--json FILE]

Prints microseconds per call and the KV bandwidth each reaches (bytes of keys and values read).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from llmserve.plugins.backends.torch.cuda.ops import decode_segments
from llmserve.plugins.backends.torch.cuda.triton_attention import decode
from report import append_jsonl  # bench/device/report.py

H, KVH, D, BS = 32, 8, 64, 16


def sdpa_gather(q, kv, table, ctx):
    B, W = table.shape
    blocks = kv.index_select(1, table.reshape(-1).long()).view(2 * KVH, B, W * BS, D)
    allowed = torch.arange(W * BS, device=q.device)[None, :] < ctx[:, None]
    qd = q.view(B, KVH, H // KVH, D).transpose(0, 1)
    o = F.scaled_dot_product_attention(qd, blocks[:KVH], blocks[KVH:], attn_mask=allowed[None, :, None, :])
    return o.transpose(0, 1).reshape(B, H, D)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'batch':>5} {'ctx':>6} {'triton us':>10} {'GB/s':>7} {'sdpa us':>9} {'GB/s':>7} {'speed-up':>8} "
          f"{'max diff':>9}")
    for B, ctx_len in ((1, 512), (1, 4096), (32, 512), (32, 2048), (128, 512), (128, 2048)):
        W = ctx_len // BS
        blocks = B * W + 1
        kv = torch.randn(2 * KVH, blocks, BS, D, dtype=torch.bfloat16, device="cuda")
        table = torch.randperm(blocks - 1, device="cuda")[: B * W].view(B, W).to(torch.int32)
        ctx = torch.full((B,), ctx_len, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        segs = decode_segments(B, KVH, sms)
        args_ = (q, kv, table, ctx)

        def triton_call(a=args_, segs=segs):
            return decode(*a, D ** -0.5, 0, segs)

        def sdpa_call(a=args_):
            return sdpa_gather(*a)

        ours, ref = do_bench(triton_call), do_bench(sdpa_call)
        diff = (triton_call().float() - sdpa_call().float()).abs().max()
        kv_bytes = 2 * B * ctx_len * KVH * D * 2
        row = {"section": "kernels", "batch": B, "ctx": ctx_len, "triton_us": ours * 1e3, "sdpa_us": ref * 1e3,
               "triton_gbs": kv_bytes / ours / 1e6, "sdpa_gbs": kv_bytes / ref / 1e6, "max_diff": float(diff)}
        print(f"{B:>5} {ctx_len:>6} {ours * 1e3:>10.1f} {row['triton_gbs']:>7.0f} {ref * 1e3:>9.1f} "
              f"{row['sdpa_gbs']:>7.0f} {ref / ours:>7.1f}x {float(diff):>9.2e}")
        append_jsonl(args.json, row)


if __name__ == "__main__":
    main()
