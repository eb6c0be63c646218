"""Triton kernels for the fused forward's small per-layer operations: residual add + RMSNorm,
SiLU(gate) * up, and RoPE on the queries and keys together with the KV store.

Each one replaces several torch launches by one, and rounds where the torch code rounds (to the
activations' dtype after each torch operation), so bf16 results match ``TorchOps`` to the bit in
the common case; fp32 differs only in summation order. One program handles one token row.
Imported only where Triton runs (CUDA, or the interpreter in tests), through ``ops.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(H, DELTA, W, OUT, s_h, s_d, s_o, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(H + row * s_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(DELTA + row * s_d + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(H + row * s_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * r).to(x.dtype).to(tl.float32)  # normalised, cast back, then scaled (transformers' order)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * s_o + cols, (w * y).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(GU, OUT, s_g, s_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(GU + row * s_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + N + cols, mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
    tl.store(OUT + row * s_o + cols, (s * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _rope_store_kernel(QKV, COS, SIN, KV, SLOTS, s_x, s_c, s_kh, s_ks,
                       HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                       HALF: tl.constexpr, STORE: tl.constexpr):
    row = tl.program_id(0)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    rows_ok = hh < HEADS + KVH  # the queries' heads, then the keys'
    ok = rows_ok[:, None]
    base = QKV + row * s_x + hh[:, None] * D + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    c1 = tl.load(COS + row * s_c + d).to(tl.float32)[None, :]
    c2 = tl.load(COS + row * s_c + HALF + d).to(tl.float32)[None, :]
    n1 = tl.load(SIN + row * s_c + d).to(tl.float32)[None, :]
    n2 = tl.load(SIN + row * s_c + HALF + d).to(tl.float32)[None, :]
    # x * cos rounded, then + rotate_half(x) * sin rounded once (torch's mul_ then addcmul_)
    a1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(x2.dtype).to(tl.float32)
    y1 = (a1 - x2.to(tl.float32) * n1).to(x1.dtype)
    y2 = (a2 + x1.to(tl.float32) * n2).to(x2.dtype)
    tl.store(base, y1, mask=ok)
    tl.store(base + HALF, y2, mask=ok)
    if STORE:
        slot = tl.load(SLOTS + row).to(tl.int64)
        if slot >= 0:
            # Keys (just rotated) and values straight from the row into the pool's slot.
            k_ok = ((hh >= HEADS) & rows_ok)[:, None]
            kh = hh - HEADS
            dst = KV + slot * s_ks + kh[:, None] * s_kh + d[None, :]
            tl.store(dst, y1.to(KV.dtype.element_ty), mask=k_ok)
            tl.store(dst + HALF, y2.to(KV.dtype.element_ty), mask=k_ok)
            v_ok = (hh < KVH)[:, None]
            vsrc = QKV + row * s_x + (HEADS + KVH + hh)[:, None] * D + d[None, :]
            vdst = KV + slot * s_ks + (KVH + hh)[:, None] * s_kh + d[None, :]
            tl.store(vdst, tl.load(vsrc, mask=v_ok, other=0.0).to(KV.dtype.element_ty), mask=v_ok)
            tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=v_ok, other=0.0).to(KV.dtype.element_ty), mask=v_ok)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    T, N = h.shape
    out = torch.empty_like(h)
    if T:
        _add_rms_norm_kernel[(T,)](h, delta if delta is not None else h, weight, out, h.stride(0),
                                   delta.stride(0) if delta is not None else 0, out.stride(0), eps, N=N,
                                   BLOCK=triton.next_power_of_2(N), HAS_DELTA=delta is not None,
                                   num_warps=4 if N <= 4096 else 8)
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    T, two = gu.shape
    n = two // 2
    out = torch.empty(T, n, dtype=gu.dtype, device=gu.device)
    block = min(4096, triton.next_power_of_2(n))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), N=n, BLOCK=block,
                                                     num_warps=4)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor | None,
               slots: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int) -> None:
    T = qkv.shape[0]
    if not T:
        return
    store = kv_slots is not None
    _rope_store_kernel[(T,)](qkv, cos, sin, kv_slots if store else qkv, slots if store else qkv, qkv.stride(0),
                             cos.stride(0), kv_slots.stride(0) if store else 0, kv_slots.stride(1) if store else 0,
                             HEADS=heads, KVH=kv_heads, D=head_dim, BLOCK_H=triton.next_power_of_2(heads + kv_heads),
                             HALF=head_dim // 2, STORE=store, num_warps=4)
