"""The native CPU kernels: built once, cached, optional; decode attention equal to a plain-torch
reference over block tables (GQA groups, sliding windows, scattered blocks, vector and portable
loops); attention sinks (gpt-oss) in the fp32 and int8 decode kernels and the prefill kernel equal
to the reference's extra softmax column, and a sink of -inf the same bits as none; the packed
linear equal to torch's for every row/column remainder; its lossless 4- and 8-bit panels bit for
bit equal to its fp32 ones, and refused wherever they would not be lossless."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from llmserve.plugins.backends.torch.native import build
from llmserve.plugins.backends.torch.native import ops as kernels
from llmserve.plugins.backends.torch.fused import TorchOps
from backends.test_prefill_kernel import reference as reference_prefill


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache and no memoised library, so each test builds (or fails) itself."""
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(build, "_loaded", {})
    return tmp_path / "kernels"


@pytest.fixture(scope="module")
def kernel():
    fn = kernels.decode_kernel()
    assert fn is not None, "the kernel must build wherever the test suite runs (gcc is part of the set-up)"
    return fn


def reference(q, pool, tables, ctx, bs, scale, window, sinks=None):
    """Attention of each sequence's one query row over its positions, read through its block table.
    ``sinks [H]``: per head one more logit as a last column of the softmax, dropped before the
    values (transformers' gpt-oss eager attention)."""
    nd, H, D = q.shape
    kvh = pool.shape[0] // 2
    G = H // kvh
    out = torch.empty_like(q)
    for i in range(nd):
        L = int(ctx[i])
        pos = torch.arange(max(0, L - window) if window else 0, L)
        blk, off = tables[i][pos // bs], pos % bs
        keys, vals = pool[:kvh, blk, off], pool[kvh:, blk, off]          # [kvh, n, D]
        for h in range(H):
            scores = q[i, h] @ keys[h // G].T * scale
            if sinks is None:
                out[i, h] = torch.softmax(scores, -1) @ vals[h // G]
            else:
                out[i, h] = torch.softmax(torch.cat((scores, sinks[h:h + 1])), -1)[:-1] @ vals[h // G]
    return out


CASES = [  # kv heads, group size, head dim, block size, window, sequences
    (3, 3, 64, 16, None, 7),     # SmolLM2's shape
    (2, 1, 32, 4, None, 5),      # no GQA
    (2, 4, 64, 16, 5, 6),        # a window shorter than a block
    (1, 2, 128, 8, 40, 4),       # a window spanning blocks
    (4, 2, 16, 1, None, 9),      # one-token blocks
    (2, 2, 24, 4, None, 5),      # a head size that is not a multiple of 16 (vector tails)
    (2, 3, 40, 8, 11, 4),        # ... with a window
    (1, 3, 12, 4, 7, 4),         # not a multiple of 8: the portable loops
]


@pytest.mark.parametrize("kvh,G,D,bs,window,nd", CASES)
def test_kernel_matches_reference(kernel, kvh, G, D, bs, window, nd) -> None:
    gen = torch.Generator().manual_seed(kvh * 100 + D)
    nblocks = 64
    pool = torch.randn(2 * kvh, nblocks + 1, bs, D, generator=gen)
    ctx = torch.randint(1, nblocks * bs // nd, (nd,), generator=gen)
    ctx[0] = 1                                                     # a sequence at its first token
    max_blocks = int(((ctx - 1) // bs + 1).max())
    order = torch.randperm(nblocks, generator=gen)                  # scattered, out-of-order blocks
    tables = torch.full((nd, max_blocks), nblocks, dtype=torch.long)  # padded with the null block
    used = 0
    for i in range(nd):
        n = int((ctx[i] - 1) // bs + 1)
        tables[i, :n] = order[used:used + n]
        used += n
    # Garbage beyond each context (never-written slots) must not leak in: NaN would show.
    for i in range(nd):
        L = int(ctx[i])
        if L % bs:
            pool[:, tables[i, (L - 1) // bs], L % bs:] = float("nan")
    q = torch.randn(nd, kvh * G, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    scale = D ** -0.5
    kernel(q, pool, tables.flatten(), ctx, out, scale, window)
    torch.testing.assert_close(out, reference(q, pool, tables, ctx, bs, scale, window), atol=1e-5, rtol=1e-5)


def test_kernel_reads_strided_queries_and_writes_rows_of_a_larger_output(kernel) -> None:
    """Queries read in place from a fused QKV row (row stride > H * D), output rows written into
    the first rows of the layer's [T, H, D] output, leaving the other rows alone."""
    kvh, G, D, bs, nd, extra = 3, 3, 64, 16, 5, 4
    H = kvh * G
    gen = torch.Generator().manual_seed(11)
    nblocks = 40
    pool = torch.randn(2 * kvh, nblocks + 1, bs, D, generator=gen)
    ctx = torch.tensor([1, 17, 100, 33, 64])
    tables = torch.randperm(nblocks, generator=gen)[: nd * 8].view(nd, 8)
    qkv = torch.randn(nd + extra, (H + 2 * kvh) * D, generator=gen)
    q = qkv[:nd, : H * D].view(nd, H, D)                       # row stride (H + 2 kvh) * D
    assert not q.is_contiguous()
    out = torch.full((nd + extra, H, D), 7.0)
    kernel(q, pool, tables.flatten(), ctx, out[:nd], D ** -0.5, None)
    want = reference(q.contiguous(), pool, tables, ctx, bs, D ** -0.5, None)
    torch.testing.assert_close(out[:nd], want, atol=1e-5, rtol=1e-5)
    assert bool((out[nd:] == 7.0).all())
    with pytest.raises(ValueError):
        kernel(q, pool, tables.flatten(), ctx, out[:nd].transpose(0, 1), D ** -0.5, None)
    with pytest.raises(ValueError):  # a pool of another head size
        kernel(q, pool[..., :32].contiguous(), tables.flatten(), ctx, out[:nd], D ** -0.5, None)


def decode_inputs(kvh: int, G: int, D: int, bs: int, nd: int, seed: int):
    """Random fp32 pool, scattered block tables, context lengths (the first sequence at its first
    token) and queries for ``nd`` decode rows."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = 48
    pool = torch.randn(2 * kvh, nblocks + 1, bs, D, generator=gen)
    ctx = torch.randint(1, nblocks * bs // nd, (nd,), generator=gen)
    ctx[0] = 1
    max_blocks = int(((ctx - 1) // bs + 1).max())
    order = torch.randperm(nblocks, generator=gen)
    tables = torch.full((nd, max_blocks), nblocks, dtype=torch.long)
    used = 0
    for i in range(nd):
        n = int((ctx[i] - 1) // bs + 1)
        tables[i, :n] = order[used:used + n]
        used += n
    q = torch.randn(nd, kvh * G, D, generator=gen)
    return pool, tables, ctx, q


def sink_logits(H: int, seed: int) -> torch.Tensor:
    """Sinks around the scores' range, one far above them (it takes nearly all the weight) and one
    far below (nearly none)."""
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0] = 12.0
    if H > 1:
        sinks[-1] = -40.0
    return sinks


SINK_CASES = [  # kv heads, group size, head dim, block size, window, sequences
    (2, 2, 64, 16, None, 5),     # vector loops, GQA 2
    (2, 3, 40, 8, 11, 4),        # vector loops with tails, GQA 3, a window spanning blocks
    (1, 3, 12, 4, 7, 4),         # not a multiple of 8: the portable loops, with a window
    (3, 1, 32, 4, None, 3),      # no GQA
]


@pytest.mark.parametrize("kvh,G,D,bs,window,nd", SINK_CASES)
def test_decode_with_sinks_matches_reference(kernel, kvh, G, D, bs, window, nd) -> None:
    pool, tables, ctx, q = decode_inputs(kvh, G, D, bs, nd, seed=kvh * 100 + G * 10 + D)
    sinks = sink_logits(kvh * G, seed=D)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, pool, tables.flatten(), ctx, out, scale, window, sinks=sinks)
    want = reference(q, pool, tables, ctx, bs, scale, window, sinks)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    plain = torch.full_like(q, float("nan"))
    kernel(q, pool, tables.flatten(), ctx, plain, scale, window)
    assert not torch.allclose(out, plain, atol=1e-3)   # the sinks did take weight
    none = torch.full_like(q, float("nan"))
    kernel(q, pool, tables.flatten(), ctx, none, scale, window, sinks=None)
    assert torch.equal(none, plain)
    # A sink of -inf adds exp(-inf) = 0 to every sum: exactly the kernel without sinks.
    kernel(q, pool, tables.flatten(), ctx, out, scale, window, sinks=torch.full((kvh * G,), float("-inf")))
    assert torch.equal(out, plain)


def test_decode_refuses_malformed_sinks(kernel) -> None:
    pool, tables, ctx, q = decode_inputs(2, 2, 16, 4, 2, seed=1)
    out = torch.empty_like(q)
    for bad in (torch.zeros(4, dtype=torch.float64), torch.zeros(5), torch.zeros(1, 4), torch.zeros(8)[::2]):
        with pytest.raises(ValueError):
            kernel(q, pool, tables.flatten(), ctx, out, 0.25, None, sinks=bad)


def dequantized(pool: torch.Tensor, D: int) -> torch.Tensor:
    """An int8 pool's rows as fp32: codes times their group's scale (as test_int8_kv_cache.py)."""
    scales = pool[..., D:].contiguous().view(torch.float32).repeat_interleave(32, -1)[..., :D]
    return pool[..., :D].float() * scales


@pytest.mark.parametrize("kvh,G,D,bs,window,nd", [(2, 2, 64, 16, None, 5), (1, 3, 40, 8, 11, 4),
                                                   (1, 2, 12, 4, None, 3)])
def test_int8_decode_and_prefill_with_sinks_match_the_dequantized_reference(kvh, G, D, bs, window, nd) -> None:
    """The int8 cache's decode kernel, and the prefill kernel over the same int8 pool, against
    the reference over the dequantized rows."""
    decode, prefill, write = kernels.decode_kernel(int8=True), kernels.prefill_kernel(), kernels.kv_writer(int8=True)
    assert None not in (decode, prefill, write), "the kernels must build wherever the test suite runs"
    f32, tables, ctx, q = decode_inputs(kvh, G, D, bs, nd, seed=D + G)
    two_kvh, nb, _, _ = f32.shape
    width = D + 4 * -(-D // 32)
    pool = torch.zeros(two_kvh, nb, bs, width, dtype=torch.int8)
    slots = torch.arange(nb * bs)
    rows = f32.view(two_kvh, nb * bs, D).transpose(0, 1)        # [slots, 2 * kvh, D]
    write(pool.view(two_kvh, nb * bs, width), slots, rows[:, :kvh], rows[:, kvh:])
    deq = dequantized(pool, D)
    sinks = sink_logits(kvh * G, seed=D)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    decode(q, pool, tables.flatten(), ctx, out, scale, window, sinks=sinks)
    torch.testing.assert_close(out, reference(q, deq, tables, ctx, bs, scale, window, sinks), atol=1e-5, rtol=1e-5)
    plain = torch.full_like(q, float("nan"))
    decode(q, pool, tables.flatten(), ctx, plain, scale, window)
    decode(q, pool, tables.flatten(), ctx, out, scale, window, sinks=torch.full((kvh * G,), float("-inf")))
    assert torch.equal(out, plain)
    # The longest sequence's context as a chunk after a prefix of a third of it.
    i = int(ctx.argmax())
    L = int(ctx[i])
    start = L // 3
    table = tables[i, :-(-L // bs)].tolist()
    chunk_q = torch.randn(L - start, kvh * G, D, generator=torch.Generator().manual_seed(5))
    got = run_prefill(prefill, chunk_q, pool, [(0, L - start, start, table)], bs, window, sinks)
    torch.testing.assert_close(got.double(), reference_prefill(chunk_q, deq, [(0, L - start, start, table)], bs,
                                                               scale, window, sinks), atol=1e-5, rtol=1e-5)


def run_prefill(fn, q, pool, chunks, bs, window, sinks=None):
    out = torch.full(q.shape, float("nan"))
    fn(q, pool, kernels.PrefillPlan(chunks, bs, pool.shape[1] - 1), out, q.shape[-1] ** -0.5, window, sinks=sinks)
    return out


@pytest.mark.parametrize("kvh,G,D,bs,window,dtype", [
    (2, 2, 64, 16, None, torch.float32),     # vector loops, GQA 2
    (1, 3, 12, 4, 9, torch.float32),         # portable loops, GQA 3, a window
    (2, 3, 40, 8, 33, torch.float32),        # a window spanning key tiles
    (2, 2, 64, 16, None, torch.bfloat16),    # a bf16 cache
    (1, 3, 24, 4, 20, torch.bfloat16),
])
def test_prefill_with_sinks_matches_reference(kvh, G, D, bs, window, dtype) -> None:
    """One call with a fresh prompt longer than a key tile, a chunk continuing a prefix that ends
    mid-block and a one-token chunk."""
    fn = kernels.prefill_kernel()
    assert fn is not None, "the kernel must build wherever the test suite runs"
    gen = torch.Generator().manual_seed(kvh * 1000 + G * 100 + D)
    shapes = [(90, 0), (40, 51), (1, 17)]                                   # (length, first position)
    nblocks = sum(-(-(n + s) // bs) for n, s in shapes) + 4
    order = torch.randperm(nblocks, generator=gen).tolist()
    chunks, row, used = [], 0, 0
    for n, start in shapes:
        need = -(-(n + start) // bs)
        chunks.append((row, n, start, order[used:used + need]))
        row, used = row + n, used + need
    pool = torch.randn(2 * kvh, nblocks + 1, bs, D, generator=gen).to(dtype)
    q = torch.randn(row, kvh * G, D, generator=gen)
    sinks = sink_logits(kvh * G, seed=D)
    got = run_prefill(fn, q, pool, chunks, bs, window, sinks)
    want = reference_prefill(q, pool, chunks, bs, D ** -0.5, window, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    plain = run_prefill(fn, q, pool, chunks, bs, window)
    torch.testing.assert_close(plain.double(), reference_prefill(q, pool, chunks, bs, D ** -0.5, window, None),
                               atol=2e-6, rtol=1e-5)
    assert torch.equal(run_prefill(fn, q, pool, chunks, bs, window, torch.full((kvh * G,), float("-inf"))), plain)
    with pytest.raises(ValueError):
        run_prefill(fn, q, pool, chunks, bs, window, sinks[:-1])


@pytest.fixture(scope="module")
def write_kv():
    fn = kernels.kv_writer()
    assert fn is not None, "the kernel must build wherever the test suite runs"
    return fn


def test_kv_write_equals_index_copy(write_kv) -> None:
    kvh, H, D, nslots, T = 2, 6, 16, 50, 7
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * kvh) * D, generator=gen)
    k = qkv[:, H * D:(H + kvh) * D].view(T, kvh, D)           # strided views of the fused row
    v = qkv[:, (H + kvh) * D:].view(T, kvh, D)
    slots = torch.tensor([3, 49, 0, 17, 18, 4, 30])
    pool = torch.randn(2 * kvh, nslots, D, generator=gen)
    want = pool.clone()
    want.index_copy_(1, slots, torch.cat((k, v), 1).transpose(0, 1))
    write_kv(pool, slots, k, v)
    torch.testing.assert_close(pool, want, atol=0, rtol=0)
    # keys laid out heads-first (transformers' [1, kvh, T, D] transposed) work as well
    kt = torch.randn(kvh, T, D, generator=gen).transpose(0, 1)
    write_kv(pool, slots, kt, v)
    want.index_copy_(1, slots, torch.cat((kt, v), 1).transpose(0, 1))
    torch.testing.assert_close(pool, want, atol=0, rtol=0)


def test_kv_write_refuses_mismatched_shapes(write_kv) -> None:
    pool = torch.zeros(4, 8, 16)
    with pytest.raises(ValueError):
        write_kv(pool, torch.tensor([0]), torch.ones(1, 2, 8), torch.ones(1, 2, 8))    # head size
    with pytest.raises(ValueError):
        write_kv(pool, torch.tensor([0]), torch.ones(1, 1, 16), torch.ones(1, 1, 16))  # kv heads
    with pytest.raises(ValueError):
        write_kv(pool, torch.tensor([0, 1]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))  # slots
    assert bool((pool == 0).all())


def test_kv_write_refuses_a_slot_outside_the_pool(write_kv) -> None:
    pool = torch.zeros(2, 8, 4)
    k = v = torch.ones(2, 1, 4)
    for bad in ([0, 8], [-1, 2]):
        with pytest.raises(IndexError):
            write_kv(pool, torch.tensor(bad), k, v)
        assert bool((pool == 0).all()), "nothing may be written when a slot is out of range"


def test_built_once_then_loaded_from_the_cache(fresh_cache, monkeypatch) -> None:
    assert kernels.decode_kernel() is not None
    built = list(fresh_cache.glob("paged_decode-*.so"))
    assert len(built) == 1
    # A second process (here: a cleared memo) must not compile again.
    monkeypatch.setattr(build, "_loaded", {})

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(build.subprocess, "run", no_compiler)
    assert kernels.decode_kernel() is not None
    assert list(fresh_cache.glob("paged_decode-*.so")) == built


def test_disabled_by_environment(fresh_cache, monkeypatch) -> None:
    """LLMSERVE_CPU_KERNELS=0 turns the backend's option off, and a cache built with it neither
    builds nor uses a kernel (the linear and elementwise kernels: test_torch_paged.py)."""
    from llmserve.plugins.backends.torch.attention import PagedKVCache
    from llmserve.plugins.backends.torch.options import TorchOptions

    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    options = TorchOptions.from_environ()
    assert options.cpu_kernels is False
    cache = PagedKVCache(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"), native=options.cpu_kernels)
    assert cache.decode_kernel is None and cache.write_kv is None
    assert not fresh_cache.exists()


def test_a_failing_compiler_falls_back_with_a_warning(fresh_cache, monkeypatch, tmp_path, caplog) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: out of cheese' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="llmserve.backend.torch"):
        assert kernels.decode_kernel() is None
    assert "out of cheese" in caplog.text and "torch path" in caplog.text
    assert not list(fresh_cache.glob("*.so"))


def test_the_backend_falls_back_to_torch_without_the_kernel(monkeypatch) -> None:
    from llmserve.plugins.backends.torch.attention import PagedKVCache

    monkeypatch.setattr(build, "_loaded", {"paged_decode": None})
    cache = PagedKVCache(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    assert cache.decode_kernel is None
    monkeypatch.setattr(build, "_loaded", {})
    assert PagedKVCache(2, 8, 4, 2, 16, torch.float32, torch.device("cpu")).decode_kernel is not None
    # Only fp32 on the CPU uses it.
    assert PagedKVCache(2, 8, 4, 2, 16, torch.bfloat16, torch.device("cpu")).decode_kernel is None


def test_cache_falls_back_to_temp_when_home_is_not_writable(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("LLMSERVE_KERNEL_CACHE", raising=False)
    not_a_dir = tmp_path / "home"
    not_a_dir.write_text("")  # ~/.cache cannot be created under a file, whoever runs the test
    monkeypatch.setattr(build.Path, "home", staticmethod(lambda: not_a_dir))
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    where = build._cache_dir()
    assert where.parent == tmp_path / "tmp" and where.name.startswith("llmserve-kernels-")


@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13, 32, 37, 300])
@pytest.mark.parametrize("N,K,bias", [(16, 8, False), (45, 33, True), (960, 576, False), (7, 1536, True)])
def test_packed_linear_equals_torch(M, N, K, bias) -> None:
    """Every row-block remainder (M mod 6), partial panels (N mod 16), odd K and the bias."""
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=gen)
    b = torch.randn(N, generator=gen) if bias else None
    x = torch.randn(M, K, generator=gen)
    lin = kernels.packed_linear(w, b)
    assert lin is not None, "the kernel must build wherever the test suite runs"
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    got = lin(x)
    assert got.shape == (M, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4 * K ** 0.5, rtol=1e-5)
    # A non-contiguous input is accepted (copied), a wrong width is refused.
    torch.testing.assert_close(lin(x.t().contiguous().t()), got)
    with pytest.raises(ValueError):
        lin(torch.zeros(M, K + 1))


def test_packed_linear_declines_what_it_cannot_do() -> None:
    assert kernels.packed_linear(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert kernels.packed_linear(torch.zeros(4)) is None
    assert kernels.packed_linear(torch.zeros(4, 4, dtype=torch.bfloat16), compact=False) is None
    assert kernels.packed_linear(torch.zeros(4, 4, dtype=torch.bfloat16)).format == "bf16"  # a bf16 checkpoint's


def q4_1_weights(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Weights as a GGUF Q4_1 block dequantizes them: per row and 32 consecutive k, an fp16
    scale d and an offset m, w = d * q + m with q in 0..15 (d * q is exact, one rounding).
    Like the quantizer, a block's smallest weight has code 0 and its largest code 15, except
    in every third block, whose codes stop at 13 (the packer must still find d)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 32, 1, generator=gen) * 0.02 + 1e-4).half().float()
    m = torch.randn(N, K // 32, 1, generator=gen) * 0.1
    q = torch.randint(0, 16, (N, K // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    q.view(-1, 32)[::3] = q.view(-1, 32)[::3].clamp(max=13)
    return (d * q + m).reshape(N, K)


def q8_0_weights(N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Weights as a GGUF Q8_0 block dequantizes them: per row and 32 consecutive k, an fp16
    scale d, w = d * q with q in -127..127 and one |q| = 127 (every third block: 125 at most)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 32, 1, generator=gen) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (N, K // 32, 32), generator=gen).float()
    q[..., 0] = 127 * (2 * torch.randint(0, 2, (N, K // 32), generator=gen) - 1)  # +-127
    q.view(-1, 32)[::3] = q.view(-1, 32)[::3].clamp(-125, 125)
    return (d * q).reshape(N, K)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K,bias", [(16, 32, False), (45, 96, True), (960, 576, False), (7, 1536, True)])
def test_quantized_panels_are_bit_for_bit_the_fp32_panels(bits, N, K, bias) -> None:
    """Every row count through both paths (straight from the codes up to 4 rows, a
    dequantized scratch panel beyond), partial panels and the bias: the same bits as fp32."""
    w = (q4_1_weights if bits == 4 else q8_0_weights)(N, K, seed=N + K)
    b = torch.randn(N) if bias else None
    coded = kernels.packed_linear(w, b)
    f32 = kernels.packed_linear(w, b, compact=False)
    assert (coded.format, f32.format) == (f"q{bits}", "f32")
    block_bytes = 384 if bits == 4 else 576  # 0.75 or 1.125 bytes per weight
    assert coded.packed.dtype == torch.uint8 and coded.packed.numel() == -(-N // 16) * K // 32 * block_bytes
    for M in (*range(1, 15), 31, 32, 37):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        assert torch.equal(coded(x), f32(x)), M
    x = torch.randn(9, K)
    torch.testing.assert_close(coded(x).double(), torch.nn.functional.linear(
        x.double(), w.double(), b.double() if b is not None else None), atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.fixture(scope="module")
def avx2_packed_linear():
    """The packed linear library built without AVX-512 (what every AVX2 CPU runs)."""
    lib = build.baseline_library("packed_linear", "linear-layer")
    assert lib is not None
    return lib


@pytest.mark.parametrize("compact,weights", [(False, "randn"), (True, "q4"), (True, "q8")])
@pytest.mark.parametrize("N,K,bias", [(45, 96, True), (960, 576, False)])
def test_avx512_panels_are_bit_for_bit_the_avx2_panels(avx2_packed_linear, compact, weights, N, K, bias) -> None:
    """The 16-wide register block (where this CPU has AVX-512) keeps each output's k-ordered FMA
    chain, so every row count gives the AVX2 build's bits (on an AVX2-only CPU both builds are
    the same code and this holds trivially)."""
    gen = torch.Generator().manual_seed(N + K)
    w = {"randn": lambda: torch.randn(N, K, generator=gen), "q4": lambda: q4_1_weights(N, K, seed=K),
         "q8": lambda: q8_0_weights(N, K, seed=K)}[weights]()
    b = torch.randn(N, generator=gen) if bias else None
    native = kernels.packed_linear(w, b, compact=compact)
    avx2 = kernels.PackedLinear(avx2_packed_linear, w, b, compact=compact)
    assert native.format == avx2.format == ("f32" if not compact else weights)
    for M in (1, 5, 12, 13, 33, 100):
        x = torch.randn(M, K, generator=gen)
        assert torch.equal(native(x), avx2(x)), M


def test_quantized_panels_only_where_they_are_lossless() -> None:
    w = q4_1_weights(40, 64)
    assert kernels.packed_linear(w).format == "q4"
    assert kernels.packed_linear(q8_0_weights(40, 64)).format == "q8"  # more than 16 values per block
    assert kernels.packed_linear(torch.randn(40, 64)).format == "f32"   # plain fp32 weights
    nudged = w.clone()
    nudged[37, 50] = torch.nextafter(nudged[37, 50], torch.tensor(1.0))       # one weight one ulp off
    assert kernels.packed_linear(nudged).format == "f32"
    assert kernels.packed_linear(q4_1_weights(40, 96)[:, :80]).format == "f32"  # K not a multiple of 32
    flat = torch.full((16, 32), -0.0)  # a flat block of -0.0: d * 0 + m would give +0.0; bf16 keeps it
    assert kernels.packed_linear(flat).format == "bf16"
    signed_zero = q8_0_weights(16, 64)
    signed_zero[3, 10] = -0.0  # 8-bit codes have no -0 (d * 0 is +0.0)
    assert kernels.packed_linear(signed_zero).format == "f32"
    assert kernels.packed_linear(torch.full((16, 32), 0.25)).format == "q4"


@pytest.mark.parametrize("N,K,bias", [(16, 32, False), (45, 96, True), (960, 576, False), (7, 1536, True)])
def test_bf16_weights_keep_half_the_bytes_and_the_fp32_products(N, K, bias) -> None:
    """Weights that are all bf16 numbers (a bf16 checkpoint served in float32) are kept as bf16
    rows, two bytes a weight, read by the GGUF kernels: every row count gives the fp32 product of
    the same weights; one weight that is not a bf16 number keeps the fp32 panels."""
    gen = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=gen).bfloat16().float()
    b = torch.randn(N, generator=gen) if bias else None
    lin = kernels.packed_linear(w, b)
    assert lin.format == "bf16" and kernels.packed_linear(w, b, compact=False).format == "f32"
    assert sum(p.data.numel() for p in lin._parts) == N * K * 2
    for M in (*range(1, 15), 31, 32, 37):
        x = torch.randn(M, K, generator=gen)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
        torch.testing.assert_close(lin(x).double(), want, atol=1e-4 * K ** 0.5, rtol=1e-5)
    nudged = w.clone()
    nudged[N - 1, K - 1] = torch.nextafter(nudged[N - 1, K - 1], torch.tensor(10.0))
    assert kernels.packed_linear(nudged, b).format == "f32"


@pytest.mark.parametrize("T,D", [(1, 576), (7, 13), (40, 64), (3, 8)])
def test_add_rms_norm_equals_torch(T, D) -> None:
    ops = kernels.elementwise_ops()
    assert ops is not None, "the kernel must build wherever the test suite runs"
    gen = torch.Generator().manual_seed(T * D)
    h, delta, w = torch.randn(T, D, generator=gen) * 3, torch.randn(T, D, generator=gen), torch.randn(D, generator=gen)
    want_h = h + delta
    want = torch.nn.functional.rms_norm(want_h, (D,), w, 1e-6)
    got = ops.add_rms_norm(h, delta, w, 1e-6)
    torch.testing.assert_close(h, want_h)  # the residual stream is updated in place
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.add_rms_norm(h.clone(), None, w, 1e-6), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        ops.add_rms_norm(h, delta[:, :1], w, 1e-6)


@pytest.mark.parametrize("T,inner", [(1, 1536), (5, 13), (32, 64)])
def test_silu_mul_equals_torch(T, inner) -> None:
    ops = kernels.elementwise_ops()
    gen = torch.Generator().manual_seed(T + inner)
    gu = torch.randn(T, 2 * inner, generator=gen) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturation and zeros
    want = torch.nn.functional.silu(gu[:, :inner]) * gu[:, inner:]
    torch.testing.assert_close(ops.silu_mul(gu), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        ops.silu_mul(gu[:, :-1])


@pytest.mark.parametrize("T,inner", [(1, 1536), (5, 13), (32, 64)])
def test_gelu_tanh_mul_equals_torch(T, inner) -> None:
    ops = kernels.elementwise_ops()
    gen = torch.Generator().manual_seed(T * inner)
    gu = torch.randn(T, 2 * inner, generator=gen) * 4
    gu[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -3.5])  # saturation, zeros, the negative dip
    want = torch.nn.functional.gelu(gu[:, :inner], approximate="tanh") * gu[:, inner:]
    torch.testing.assert_close(ops.gelu_tanh_mul(gu), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        ops.gelu_tanh_mul(gu[:, :-1])


@pytest.mark.parametrize("T,H,kvh,D", [(1, 16, 8, 128), (5, 4, 2, 20), (33, 8, 8, 64)])
def test_qk_norm_normalises_each_head_in_place(T, H, kvh, D) -> None:
    """Every query and key head on its own (queries with one weight, keys with the other);
    the values after them untouched, as in a fused QKV output."""
    ops = kernels.elementwise_ops()
    gen = torch.Generator().manual_seed(T * H * D)
    qkv = torch.randn(T, (H + 2 * kvh) * D, generator=gen) * 5
    qw, kw = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    q, k, v = qkv.split([H * D, kvh * D, kvh * D], dim=1)
    want_q = torch.nn.functional.rms_norm(q.reshape(T, H, D), (D,), qw, 1e-6).reshape(T, -1)
    want_k = torch.nn.functional.rms_norm(k.reshape(T, kvh, D), (D,), kw, 1e-6).reshape(T, -1)
    want_v = v.clone()
    ops.qk_norm(qkv, H, kvh, D, qw, kw, 1e-6)
    torch.testing.assert_close(qkv[:, :H * D], want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, H * D:(H + kvh) * D], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (H + kvh) * D:], want_v)
    torch_qkv = torch.randn(T, (H + 2 * kvh) * D, generator=gen)
    native_qkv = torch_qkv.clone()
    TorchOps.qk_norm(torch_qkv, H, kvh, D, qw, kw, 1e-6)
    ops.qk_norm(native_qkv, H, kvh, D, qw, kw, 1e-6)
    torch.testing.assert_close(native_qkv, torch_qkv, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        ops.qk_norm(qkv, H, kvh, D, qw[:-1], kw, 1e-6)


def test_a_changed_header_rebuilds(fresh_cache, monkeypatch, tmp_path) -> None:
    """The cache key covers the shared headers, not only the kernel's own source."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for f in build.CSRC.iterdir():
        (csrc / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC", csrc)
    assert kernels.elementwise_ops() is not None
    (csrc / "vec_math.h").write_text((csrc / "vec_math.h").read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "_loaded", {})
    assert kernels.elementwise_ops() is not None
    assert len(list(fresh_cache.glob("elementwise-*.so"))) == 2


def test_greedy_pick_equals_argmax_and_log_softmax() -> None:
    ops = kernels.elementwise_ops()
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 1003, generator=gen) * 4    # V not a multiple of 8: the tails
    logits[1, 5] = logits[1, 900] = 50.0                # a tie: the first index wins, as argmax
    logits[2, :500] = float("-inf")                     # masked tokens
    logits[3, 1001] = 60.0                              # the maximum in the scalar tail
    tokens, lps = ops.greedy(logits)
    torch.testing.assert_close(tokens, logits.argmax(-1))
    want = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("poison", ["nan", "all -inf"])
def test_greedy_pick_leaves_undecidable_rows_to_the_caller(poison) -> None:
    ops = kernels.elementwise_ops()
    logits = torch.randn(3, 64)
    if poison == "nan":
        logits[1, 17] = float("nan")
    else:
        logits[1] = float("-inf")
    assert ops.greedy(logits) is None


@pytest.mark.parametrize("T,heads,extra,D", [(1, 12, 3, 64), (5, 2, 0, 20), (3, 1, 1, 6)])
def test_rope_equals_rotate_half(T, heads, extra, D) -> None:
    """In place on the first ``heads`` heads of wider rows (values after them stay untouched)."""
    ops = kernels.elementwise_ops()
    gen = torch.Generator().manual_seed(T * heads + D)
    x = torch.randn(T, (heads + extra) * D, generator=gen)
    cos, sin = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    qk = x[:, :heads * D].view(T, heads, D)
    half = D // 2
    want = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[:, None]
    rest = x[:, heads * D:].clone()
    ops.rope(x, heads, D, cos, sin)
    torch.testing.assert_close(x[:, :heads * D].view(T, heads, D), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(x[:, heads * D:], rest)
    with pytest.raises(ValueError):
        ops.rope(x, heads + extra + 1, D, cos, sin)
