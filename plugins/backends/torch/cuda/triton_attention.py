"""Triton kernels over the paged KV cache: decode attention that reads the pools in place
(GQA, sliding windows, an optional split over the context) and the KV store.

The pool layout is ``PagedKVCache``'s: per layer ``[2 * kv_heads, blocks, block_size, head_dim]``,
keys in heads ``0 .. kvh-1`` and values in ``kvh .. 2*kvh-1``. A decode row attends to the first
``ctx`` positions of its sequence (the last ``window`` of them with a window); each program
gathers its tokens' slots from the block table, so no key or value is copied. Unwritten or
padded positions are masked at the load (``other=0``): garbage in them, NaN included, never
reaches the output. Rows with ``ctx == 0`` (padding of a CUDA graph's bucket) write zeros.

Imported only where Triton runs: on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (the
tests); ``ops.py`` registers the torch operators that call these launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Masked scores are -inf; the running maximum starts finite so that a tile (or a whole
# segment) with nothing to attend gives exp(-inf - m) = 0, never exp(-inf + inf) = NaN.
_M_START = -1.0e30


@triton.jit
def _attend_tile(q, k_base, v_base, off, kv_mask, d, allowed, scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of keys and values into the online softmax: ``allowed`` [rows, tile] says which
    (query, key) pairs count; returns the updated running maximum, sum and accumulator."""
    k = tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.where(allowed, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(v_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)


@triton.jit
def _decode_kernel(Q, KV, TABLE, CTX, OUT, M_OUT, L_OUT,
                   s_qb, s_qh, s_kh, s_kb, s_kt, s_tb, s_ob, s_oh, s_mb, s_mh,
                   scale, window, n_segments,
                   KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                   SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    ctx = tl.load(CTX + b)
    lo = tl.maximum(ctx - window, 0)  # the launcher passes a window past any context for none
    first = lo // TILE
    last = (ctx + TILE - 1) // TILE
    per = (last - first + n_segments - 1) // n_segments
    t0 = first + seg * per
    t1 = tl.minimum(t0 + per, last)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(Q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], _M_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, TILE)
    k_base = KV + h * s_kh
    v_base = KV + (KVH + h) * s_kh
    for t in range(t0, t1):
        pos = t * TILE + n
        ok = (pos < ctx) & (pos >= lo)
        blk = tl.load(TABLE + b * s_tb + pos // BS, mask=ok, other=0)
        off = blk.to(tl.int64) * s_kb + (pos % BS) * s_kt
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, off, ok[:, None] & d_ok[None, :], d, ok[None, :], scale,
                                     m_i, l_i, acc, PRECISION)
    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Unnormalised partials per segment; _reduce_kernel merges them.
        part = b * s_mb + (h * G + g) * s_mh + seg
        tl.store(M_OUT + part, m_i, mask=g_ok)
        tl.store(L_OUT + part, l_i, mask=g_ok)
        tl.store(OUT + part[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(OUT + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :], o.to(OUT.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _prefill_kernel(Q, KV, TABLE, ROW, LEN, START, OUT, s_qt, s_qh, s_kh, s_kb, s_kt, s_tb, s_ot, s_oh,
                    scale, window,
                    KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
    # One program: BLOCK_M query tokens of one prompt chunk x the G query heads of one KV head,
    # as BLOCK_M * BLOCK_G rows (token-major), over the chunk's keys already in the pool.
    seg = tl.program_id(0)
    m = tl.program_id(1)
    h = tl.program_id(2)
    n_rows = tl.load(LEN + seg)
    if m * BLOCK_M < n_rows:
        row0 = tl.load(ROW + seg)
        start = tl.load(START + seg)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        i = m * BLOCK_M + r // BLOCK_G
        g = r % BLOCK_G
        ok = (i < n_rows) & (g < G)
        q_pos = start + i
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + (row0 + i)[:, None] * s_qt + (h * G + g)[:, None] * s_qh + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_G], _M_START, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
        first_pos = start + m * BLOCK_M
        last_pos = start + tl.minimum(m * BLOCK_M + BLOCK_M, n_rows)  # one past the tile's last query
        lo = tl.maximum(first_pos - window + 1, 0)
        n = tl.arange(0, TILE)
        k_base = KV + h * s_kh
        v_base = KV + (KVH + h) * s_kh
        for t in range(lo // TILE, (last_pos + TILE - 1) // TILE):
            pos = t * TILE + n
            in_ctx = pos < last_pos
            blk = tl.load(TABLE + seg * s_tb + pos // BS, mask=in_ctx, other=0)
            off = blk.to(tl.int64) * s_kb + (pos % BS) * s_kt
            allowed = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & in_ctx[None, :]
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, off, in_ctx[:, None] & d_ok[None, :], d, allowed, scale,
                                         m_i, l_i, acc, PRECISION)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + (row0 + i)[:, None] * s_ot + (h * G + g)[:, None] * s_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(ACC, M_IN, L_IN, OUT, s_mb, s_mh, s_ob, s_oh, n_segments,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_segments
    part = b * s_mb + hq * s_mh + s
    m = tl.load(M_IN + part, mask=s_ok, other=_M_START)
    lsum = tl.load(L_IN + part, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp(m - m_all)
    total = tl.sum(lsum * w, 0)
    acc = tl.load(ACC + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * s_ob + hq * s_oh + d, o.to(OUT.dtype.element_ty), mask=d < D)


@triton.jit
def _store_kernel(K, V, SLOTS, KV, s_kt, s_kth, s_vt, s_vth, s_kh, s_ks,
                  KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # negative: a padded row, written nowhere
        hh = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = (hh < KVH)[:, None] & (d < D)[None, :]
        dst = KV + slot * s_ks + hh[:, None] * s_kh + d[None, :]
        k = tl.load(K + t * s_kt + hh[:, None] * s_kth + d[None, :], mask=ok)
        v = tl.load(V + t * s_vt + hh[:, None] * s_vth + d[None, :], mask=ok)
        tl.store(dst, k.to(KV.dtype.element_ty), mask=ok)
        tl.store(dst + KVH * s_kh, v.to(KV.dtype.element_ty), mask=ok)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, scale: float,
           window: int, segments: int) -> torch.Tensor:
    """Decode attention: ``q [B, H, D]`` (row and head strides free, last dim contiguous), one
    layer's pool ``kv [2*kvh, blocks, bs, D]``, ``table [B, W]`` block ids, ``ctx [B]`` ->
    ``[B, H, D]`` in q's dtype. ``window`` 0 means none; ``segments`` > 1 splits each row's
    context into that many parts run side by side (long contexts at small batch)."""
    B, H, D = q.shape
    kvh, _, bs, _ = kv.shape
    kvh //= 2
    G = H // kvh
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_d, block_g = _pow2(D, 16), _pow2(G, 16)
    tile = max(16, min(64, 8192 // block_d))  # keys per iteration: 64 at D=64, 32 at D=128...
    # Products in fp32 from loads of any dtype: bf16 and fp16 values are exact in tf32, so their
    # products on tensor cores lose nothing; an fp32 cache needs IEEE products (TF32 would round
    # its keys and break greedy equality with the reference).
    precision = "ieee" if torch.float32 in (q.dtype, kv.dtype) else "tf32"
    span = window if window > 0 else 2**30
    common = dict(KVH=kvh, G=G, D=D, BS=bs, BLOCK_G=block_g, BLOCK_D=block_d, TILE=tile, PRECISION=precision,
                  num_warps=4)
    if segments <= 1:
        _decode_kernel[(B, kvh, 1)](q, kv, table, ctx, out, out, out,
                                    q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
                                    table.stride(0), out.stride(0), out.stride(1), 0, 0,
                                    scale, span, 1, SPLIT=False, **common)
        return out
    acc = torch.empty(B, H, segments, block_d, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, segments, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    _decode_kernel[(B, kvh, segments)](q, kv, table, ctx, acc, m, lsum,
                                       q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
                                       table.stride(0), 0, 0, m.stride(0), m.stride(1),
                                       scale, span, segments, SPLIT=True, **common)
    _reduce_kernel[(B, H)](acc, m, lsum, out, m.stride(0), m.stride(1), out.stride(0), out.stride(1), segments,
                           D=D, BLOCK_D=block_d, BLOCK_S=_pow2(segments), num_warps=1)
    return out


def prefill(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
            starts: torch.Tensor, out: torch.Tensor, scale: float, window: int, longest: int) -> None:
    """Causal attention of prompt chunks, written into ``out [T, H, D]``: chunk ``s`` is packed rows
    ``rows[s] ..`` (``lens[s]`` of them) at positions ``starts[s] ..`` of a sequence whose blocks
    ``table[s]`` lists; its keys and values (the chunk's own included) are read from the pool
    ``kv [2*kvh, blocks, bs, D]``. ``longest``: the longest chunk (sizes the grid)."""
    S = table.shape[0]
    if S == 0 or longest == 0:
        return
    H, D = q.shape[1], q.shape[2]
    kvh, _, bs, _ = kv.shape
    kvh //= 2
    G = H // kvh
    block_g, block_d = _pow2(G), _pow2(D, 16)
    block_m = max(1, 64 // block_g)  # 64 query rows a program (tokens x heads of the group)
    precision = "ieee" if torch.float32 in (q.dtype, kv.dtype) else "tf32"
    tile = 32 if block_d > 64 else 64
    _prefill_kernel[(S, triton.cdiv(longest, block_m), kvh)](
        q, kv, table, rows, lens, starts, out, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        table.stride(0), out.stride(0), out.stride(1), scale, window if window > 0 else 2**30,
        KVH=kvh, G=G, D=D, BS=bs, BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_D=block_d, TILE=tile,
        PRECISION=precision, num_warps=4)


def store(kv_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``/``v [T, kvh, D]`` (last dim contiguous) into one layer's pool viewed as
    ``kv_slots [2*kvh, slots, D]`` at ``slots [T]``; negative slots are skipped."""
    T, kvh, D = k.shape
    if T == 0:
        return
    _store_kernel[(T,)](k, v, slots, kv_slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        kv_slots.stride(0), kv_slots.stride(1),
                        KVH=kvh, D=D, BLOCK_H=_pow2(kvh), BLOCK_D=_pow2(D), num_warps=1)
