"""The native prefill-attention kernel (``csrc/paged_prefill.c``) against a float64 reference:
prompt chunks attending causally to their cached prefix and to themselves, read through block
tables in place; every split of a prompt into prefix and chunk, block boundaries, GQA groups,
sliding windows, fp32 and bf16 pools, vector and portable loops, several chunks in one call,
and the shape checks of its wrapper."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmserve.plugins.backends.torch.native import ops as kernels


@pytest.fixture(scope="module")
def kernel():
    fn = kernels.prefill_kernel()
    assert fn is not None, "the kernel must build wherever the test suite runs (gcc is part of the set-up)"
    return fn


def reference(q, pool, chunks, bs, scale, window, sinks=None, key_end=None):
    """Each chunk's rows: attention of its queries (positions start ..) over positions 0 .. its
    last, causal (and windowed), in float64, keys and values read through its block table;
    ``sinks [H]`` (or None) as a last softmax column, then dropped; ``key_end`` (per packed row,
    or None) the last key each row sees in place of its own position."""
    T, H, D = q.shape
    kvh = pool.shape[0] // 2
    G = H // kvh
    out = torch.zeros(T, H, D, dtype=torch.float64)
    pool = pool.double()
    for row, n, start, table in chunks:
        pos = torch.arange(start + n)
        blk, off = torch.tensor(table)[pos // bs], pos % bs
        keys, vals = pool[:kvh, blk, off], pool[kvh:, blk, off]                 # [kvh, ctx, D]
        q_pos, k_pos = torch.arange(start, start + n)[:, None], pos[None, :]
        allowed = k_pos <= (q_pos if key_end is None else key_end[row:row + n, None])
        if window:
            allowed &= k_pos > q_pos - window
        for h in range(H):
            scores = (q[row:row + n, h].double() @ keys[h // G].T * scale).masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                scores = torch.cat((scores, sinks[h].double().expand(n, 1)), -1)
            weights = torch.softmax(scores, -1)
            out[row:row + n, h] = (weights[:, :-1] if sinks is not None else weights) @ vals[h // G]
    return out


def scattered_tables(lengths: list[int], bs: int, nblocks: int, gen: torch.Generator) -> list[list[int]]:
    """One block table per context length, its blocks drawn out of order from one pool."""
    order = torch.randperm(nblocks, generator=gen).tolist()
    tables, used = [], 0
    for ctx in lengths:
        n = -(-ctx // bs)
        assert used + n <= nblocks
        tables.append(order[used:used + n])
        used += n
    return tables


def poison_past_contexts(pool: torch.Tensor, chunks: list, bs: int) -> None:
    """NaN in every slot past a chunk's last position: never-written slots must not be read."""
    for _, n, start, table in chunks:
        ctx = start + n
        if ctx % bs:
            pool[:, table[(ctx - 1) // bs], ctx % bs:] = float("nan")


def run(kernel, q, pool, chunks, bs, window, out=None, key_end=None):
    out = torch.full(q.shape, float("nan")) if out is None else out
    plan = kernels.PrefillPlan(chunks, bs, pool.shape[1] - 1, key_end)
    kernel(q, pool, plan, out, q.shape[-1] ** -0.5, window)
    return out


CASES = [  # kv heads, group size, head dim, block size, window, pool dtype
    (3, 3, 64, 16, None, torch.float32),     # SmolLM2-135M's shape
    (8, 4, 64, 16, None, torch.float32),     # Llama-3.2-1B's shape
    (2, 1, 32, 4, None, torch.float32),      # no GQA
    (2, 4, 64, 16, 5, torch.float32),        # a window shorter than a block
    (1, 2, 128, 8, 70, torch.float32),       # a window spanning key tiles
    (2, 7, 24, 1, None, torch.float32),      # one-token blocks, head size not a multiple of 16
    (1, 3, 12, 4, 9, torch.float32),         # not a multiple of 8: the portable loops
    (2, 4, 64, 16, None, torch.bfloat16),    # a bf16 cache read by fp32 queries
    (2, 2, 40, 8, 33, torch.bfloat16),
]


@pytest.mark.parametrize("kvh,G,D,bs,window,dtype", CASES)
def test_chunks_match_reference(kernel, kvh, G, D, bs, window, dtype) -> None:
    """One call with chunks of every kind: a one-token chunk, a fresh prompt, chunks continuing a
    prefix that ends mid-block and at a block boundary, one longer than several key tiles."""
    gen = torch.Generator().manual_seed(kvh * 1000 + G * 100 + D)
    shapes = [(1, 0), (70, 0), (33, 50), (130, 128), (5, 17), (200, 3)]   # (length, first position)
    tables = scattered_tables([n + s for n, s in shapes], bs, 600 // bs + 40, gen)
    chunks, row = [], 0
    for (n, start), table in zip(shapes, tables):
        chunks.append((row, n, start, table))
        row += n
    pool = torch.randn(2 * kvh, 600 // bs + 41, bs, D, generator=gen).to(dtype)
    poison_past_contexts(pool, chunks, bs)
    q = torch.randn(row, kvh * G, D, generator=gen)
    got = run(kernel, q, pool, chunks, bs, window)
    torch.testing.assert_close(got.double(), reference(q, pool, chunks, bs, D ** -0.5, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 300])
def test_every_prefix_split_of_a_long_prompt(kernel, window) -> None:
    """A 4096-token prompt cut into a cached prefix and a chunk at every block boundary and one
    position either side of it (and every split of its first 40 positions): each chunk's rows
    equal the same rows of the whole prompt's attention."""
    kvh, G, D, bs, L = 1, 2, 16, 16, 4096
    gen = torch.Generator().manual_seed(7)
    (table,) = scattered_tables([L], bs, L // bs + 8, gen)
    pool = torch.randn(2 * kvh, L // bs + 9, bs, D, generator=gen)
    q_all = torch.randn(L, kvh * G, D, generator=gen) * 3                # peaked softmaxes too
    whole = reference(q_all, pool, [(0, L, 0, table)], bs, D ** -0.5, window)
    splits = sorted({*range(40), *(s + d for s in range(bs, L, 256) for d in (-1, 0, 1)), L - 1})
    for group in (splits[i:i + 24] for i in range(0, len(splits), 24)):   # several chunks per call
        chunks, rows = [], []
        for s in group:
            chunks.append((sum(L - x for x in group[:len(chunks)]), L - s, s, table))
            rows.append(q_all[s:])
        got = run(kernel, torch.cat(rows), pool, chunks, bs, window)
        for (_, _, s, _), part in zip(chunks, got.split([c[1] for c in chunks])):
            torch.testing.assert_close(part.double(), whole[s:], atol=2e-6, rtol=1e-5, msg=f"split at {s}")


@pytest.mark.parametrize("kvh,G,D,bs,window,dtype", [CASES[0], CASES[3], CASES[4], CASES[6], CASES[8]])
def test_rows_that_see_later_keys_match_reference(kernel, kvh, G, D, bs, window, dtype) -> None:
    """Runs of rows that attend to each other both ways (an image's tokens, Gemma 3): each row sees
    keys up to its run's end. Runs at a chunk's start, crossing query tiles and key tiles, longer
    than the window, and one that began in the cached prefix (its earlier rows computed before)."""
    gen = torch.Generator().manual_seed(kvh * 1000 + G * 100 + D + 1)
    shapes = [(40, 0, [(0, 16)]), (300, 20, [(30, 286), (290, 300)]), (50, 100, [(90, 120), (130, 131)])]
    tables = scattered_tables([n + s for n, s, _ in shapes], bs, 600 // bs + 40, gen)
    chunks, limits, row = [], [], 0
    for (n, start, runs), table in zip(shapes, tables):
        chunks.append((row, n, start, table))
        ends = list(range(start, start + n))
        for a, b in runs:
            ends[max(a, start) - start:b - start] = [b - 1] * (b - max(a, start))
        limits += ends
        row += n
    pool = torch.randn(2 * kvh, 600 // bs + 41, bs, D, generator=gen).to(dtype)
    poison_past_contexts(pool, chunks, bs)
    q = torch.randn(row, kvh * G, D, generator=gen)
    key_end = torch.tensor(limits)
    got = run(kernel, q, pool, chunks, bs, window, key_end=key_end)
    want = reference(q, pool, chunks, bs, D ** -0.5, window, key_end=key_end)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(want, reference(q, pool, chunks, bs, D ** -0.5, window))  # the runs matter
    for bad in (start - 1, start + n):  # before a row's own position, past the chunk's last
        wrong = key_end.clone()
        wrong[row - 1] = bad
        with pytest.raises(ValueError, match="key limits"):
            kernels.PrefillPlan(chunks, bs, pool.shape[1] - 1, wrong)


def test_strided_queries_and_rows_of_a_larger_output(kernel) -> None:
    """Queries read in place from a fused QKV output (row stride past H * D); the chunk's rows of
    the layer's output written, the decode rows before them left alone."""
    kvh, G, D, bs, nd = 2, 3, 64, 16, 3
    H = kvh * G
    gen = torch.Generator().manual_seed(3)
    (table,) = scattered_tables([90], bs, 20, gen)
    pool = torch.randn(2 * kvh, 21, bs, D, generator=gen)
    qkv = torch.randn(nd + 40, (H + 2 * kvh) * D, generator=gen)
    q = qkv[:, :H * D].view(nd + 40, H, D)
    assert not q.is_contiguous()
    out = torch.full((nd + 40, H, D), 7.0)
    chunks = [(nd, 40, 50, table)]
    run(kernel, q, pool, chunks, bs, None, out)
    want = reference(q.contiguous(), pool, chunks, bs, D ** -0.5, None)
    torch.testing.assert_close(out[nd:].double(), want[nd:], atol=2e-6, rtol=1e-5)
    assert bool((out[:nd] == 7.0).all())


def test_wrapper_refuses_what_does_not_fit(kernel) -> None:
    kvh, D, bs = 2, 32, 16
    pool = torch.randn(2 * kvh, 9, bs, D)
    q, out = torch.randn(20, 4, D), torch.empty(20, 4, D)
    good = [(0, 20, 0, [0, 1])]
    with pytest.raises(ValueError):  # a block table too short for the chunk's positions
        kernels.PrefillPlan([(0, 20, 0, [0])], bs, 8)
    with pytest.raises(ValueError):  # a negative block id
        kernels.PrefillPlan([(0, 20, 0, [0, -1])], bs, 8)
    with pytest.raises(ValueError):  # a block outside the pool
        kernel(q, pool, kernels.PrefillPlan([(0, 20, 0, [0, 9])], bs, 8), out, 1.0, None)
    with pytest.raises(ValueError):  # rows past the step's queries
        kernel(q, pool, kernels.PrefillPlan([(10, 20, 0, [0, 1])], bs, 8), out, 1.0, None)
    with pytest.raises(ValueError):  # a plan made for another block size
        kernel(q, pool, kernels.PrefillPlan(good, 8, 8), out, 1.0, None)
    with pytest.raises(ValueError):  # a pool dtype the kernel does not read
        kernel(q, pool.half(), kernels.PrefillPlan(good, bs, 8), out, 1.0, None)
    with pytest.raises(ValueError):  # a pool of another head size
        kernel(q, pool[..., :16].contiguous(), kernels.PrefillPlan(good, bs, 8), out, 1.0, None)
    kernel(q, pool, kernels.PrefillPlan(good, bs, 8), out, 1.0, None)
    assert torch.isfinite(out).all()
