"""The Triton paged-attention and KV-store kernels, run by Triton's interpreter on the CPU,
against a float64 computation of the same attention (and the torch operators' CPU code)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from llmserve.plugins.backends.torch.cuda import ops
from llmserve.plugins.backends.torch.cuda import triton_attention as ta

# tests/conftest.py turns the interpreter on where no GPU is; with one, the kernels run on it.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on the kernels' device (a copy on the CPU too: a kernel must not write the original)."""
    return t.to(DEVICE, copy=True)

BS = 16


def make_pool(kvh: int, blocks: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    # NaN everywhere: a kernel that reads an unwritten slot poisons its output.
    return torch.full((2 * kvh, blocks, BS, D), float("nan"), dtype=dtype)


def fill(pool: torch.Tensor, table: list[list[int]], ctx: list[int], gen: torch.Generator) -> None:
    for row, n in zip(table, ctx):
        for p in range(n):
            pool[:, row[p // BS], p % BS] = torch.randn(pool.shape[0], pool.shape[3], generator=gen).to(pool.dtype)


def expected(q: torch.Tensor, pool: torch.Tensor, table: list[list[int]], ctx: list[int], scale: float,
             window: int) -> torch.Tensor:
    """Float64 attention, one row and head at a time."""
    B, H, D = q.shape
    kvh = pool.shape[0] // 2
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        lo = max(0, ctx[b] - window) if window else 0
        if ctx[b] == 0:
            continue
        pos = list(range(lo, ctx[b]))
        blk = torch.tensor([table[b][p // BS] for p in pos])
        off = torch.tensor([p % BS for p in pos])
        for h in range(H):
            kh = h // (H // kvh)
            k = pool[kh, blk, off].double()
            v = pool[kvh + kh, blk, off].double()
            w = torch.softmax(k @ q[b, h].double() * scale, 0)
            out[b, h] = w @ v
    return out


CASES = [  # (contexts, query heads, kv heads, window)
    ([1], 4, 4, 0), ([15], 4, 1, 0), ([16], 8, 2, 0), ([17], 4, 1, 0), ([70], 8, 2, 0),
    ([1, 17, 70], 4, 4, 0), ([15, 16, 70], 8, 2, 0), ([70, 3, 33], 4, 1, 20),
    ([0, 17, 0], 8, 2, 0),  # padded rows (a graph bucket's spare rows) give zeros
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("ctx,H,kvh,window", CASES)
def test_decode_matches_float64(ctx, H, kvh, window, segments, dtype):
    gen = torch.Generator().manual_seed(len(ctx) * 100 + sum(ctx) + H + window)
    D, B = 64, len(ctx)
    W = max(1, max(math.ceil(c / BS) for c in ctx))
    blocks = B * W + 2
    perm = torch.randperm(blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    table = [perm[b * W:(b + 1) * W] for b in range(B)]
    pool = make_pool(kvh, blocks, D, dtype)
    fill(pool, table, ctx, gen)
    # Queries as a strided view of a wider row, as the fused QKV output hands them over.
    wide = torch.randn(B, (H + 2 * kvh) * D, generator=gen).to(dtype)
    q = wide[:, :H * D].view(B, H, D)
    t = torch.tensor(table, dtype=torch.int32)
    c = torch.tensor(ctx, dtype=torch.int32)
    scale = D ** -0.5
    got = ta.decode(dev(q), dev(pool), dev(t), dev(c), scale, window, segments).cpu()
    want = expected(q, pool, table, ctx, scale, window)
    assert not got.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol), (got.double() - want).abs().max()
    ref = ops.reference_decode(q, pool, t, c, scale, window)  # the operator's CPU code agrees too
    assert torch.allclose(ref.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kvh", [1, 3])
def test_store_writes_slots_and_skips_negative(kvh):
    gen = torch.Generator().manual_seed(kvh)
    D, blocks = 32, 4
    pool = torch.zeros(2 * kvh, blocks * BS, D)
    wide = torch.randn(5, (2 + 2 * kvh) * D, generator=gen)
    k = wide[:, 2 * D:(2 + kvh) * D].view(5, kvh, D)
    v = wide[:, (2 + kvh) * D:].view(5, kvh, D)
    slots = torch.tensor([3, -1, 40, 17, -1], dtype=torch.int32)
    on = dev(pool)
    ta.store(on, dev(slots), dev(k), dev(v))
    pool = on.cpu()
    want = torch.zeros_like(pool)
    ops.store_kv(want, slots, k, v)  # the operator's CPU code
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(pool[:kvh, s], k[t]) and torch.equal(pool[kvh:, s], v[t])
    assert torch.equal(pool, want)
    assert int((pool != 0).any(-1).any(0).sum()) == 3  # only the three real slots were written


def test_decode_operator_on_meta_has_the_query_shape():
    q = torch.empty(3, 8, 64, device="meta")
    kv = torch.empty(4, 10, BS, 64, device="meta")
    out = torch.ops.llmserve.paged_decode(q, kv, torch.empty(3, 2, dtype=torch.int32, device="meta"),
                                          torch.empty(3, dtype=torch.int32, device="meta"), 0.125, 0, 1)
    assert out.shape == (3, 8, 64) and out.device.type == "meta"


def test_segments_fill_the_device():
    assert ops.decode_segments(1, 8, 132) == 16
    assert ops.decode_segments(32, 8, 132) == 1
    assert ops.decode_segments(4, 8, 132) == 8


def expected_prefill(q, pool, table, rows, lens, starts, scale, window):
    """Float64 causal attention of each chunk's rows, one row and head at a time."""
    H = q.shape[1]
    kvh = pool.shape[0] // 2
    out = torch.zeros(q.shape, dtype=torch.float64)
    for tbl, r0, n, st in zip(table, rows, lens, starts):
        for i in range(n):
            qp = st + i
            pos = [p for p in range(qp + 1) if not window or p > qp - window]
            blk = torch.tensor([tbl[p // BS] for p in pos])
            off = torch.tensor([p % BS for p in pos])
            for h in range(H):
                kh = h // (H // kvh)
                w = torch.softmax(pool[kh, blk, off].double() @ q[r0 + i, h].double() * scale, 0)
                out[r0 + i, h] = w @ pool[kvh + kh, blk, off].double()
    return out


PREFILL_CASES = [  # (chunks as (cached prefix, chunk length), query heads, kv heads, window)
    ([(0, 5)], 4, 4, 0), ([(16, 1), (3, 17)], 4, 1, 0), ([(40, 33)], 8, 2, 0), ([(7, 9), (0, 20)], 9, 3, 0),
    ([(30, 12), (5, 40)], 4, 1, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks,H,kvh,window", PREFILL_CASES)
def test_prefill_matches_float64(chunks, H, kvh, window, dtype):
    gen = torch.Generator().manual_seed(sum(a + b for a, b in chunks) + H + window)
    D = 64
    ctxs = [a + b for a, b in chunks]
    W = max(math.ceil(c / BS) for c in ctxs)
    blocks = len(chunks) * W + 1
    perm = torch.randperm(blocks, generator=gen).tolist()
    table = [perm[s * W:(s + 1) * W] for s in range(len(chunks))]
    pool = make_pool(kvh, blocks, D, dtype)
    fill(pool, table, ctxs, gen)
    lens = [b for _, b in chunks]
    rows = [sum(lens[:s]) + 2 for s in range(len(chunks))]   # two decode rows first, as in a mixed step
    T = rows[-1] + lens[-1]
    q = torch.randn(T, (H + 2 * kvh) * D, generator=gen).to(dtype)[:, :H * D].view(T, H, D)
    args = [torch.tensor(x, dtype=torch.int32) for x in (table, rows, lens, [a for a, _ in chunks])]
    scale = D ** -0.5
    out = torch.full((T, H, D), float("nan"), dtype=dtype)
    on = dev(out)
    ta.prefill(dev(q), dev(pool), *(dev(a) for a in args), on, scale, window, max(lens))
    got = on.cpu()
    want = expected_prefill(q, pool, table, rows, lens, [a for a, _ in chunks], scale, window)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert got[:2].isnan().all()            # rows of no chunk are left alone
    assert torch.allclose(got[2:].double(), want[2:], atol=tol, rtol=tol), (got[2:].double() - want[2:]).abs().max()
    ref = torch.full((T, H, D), float("nan"), dtype=dtype)
    ops.reference_prefill(q, pool, *args, ref, scale, window)   # the operator's CPU code agrees too
    assert torch.allclose(ref[2:].double(), want[2:], atol=tol, rtol=tol)
