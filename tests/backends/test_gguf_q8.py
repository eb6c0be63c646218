"""The int8-activation path of the GGUF linears (``gguf_linear(..., int8=True)``, ``csrc/gguf_q8.h``).

Up to ``int8_rows()`` rows of x (64 with AVX-512 VNNI, 16 otherwise), against Q8_0, Q4_0, Q5_0,
Q4_K, Q5_K and Q6_K parts, the kernel equals an fp64
reference of its documented arithmetic: each row of x quantized per 32 (``d = max|x| / 127``,
``q = rint(x / d)`` with ties to even, in fp32), then ``sum_b d[b] * (q[b] . dequantize(W)[b])``,
to fp32 rounding (observed: 6e-7 of ``max|y|``); and it is never farther from the exact fp32
kernel than rounding x to 8 bits can move an output (``rounding_bound``; observed on random blocks
and Gaussian x: up to 2.7e-2 of a row's ``max|y|``). On a CPU with AVX-512 the build without it (the 8-lane code every
AVX2 CPU runs) is held to the same reference. Parts of other types, and more rows, are the exact
kernel's bits; the thread count changes no bit; zero rows and zero blocks give zeros."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from llmserve.plugins.backends.torch.native import build, gguf_ops

import test_gguf_kernels as kernels
from test_gguf_kernels import T, quant, random_blocks, samples

native = kernels.native  # the library fixtures
avx2_only = kernels.avx2_only
SERVED = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]


def quantize_x(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Codes ``[M, K / 32, 32]`` and scales ``[M, K / 32]`` as the kernel forms them (fp32 steps)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    d[~(d > 0)] = 0
    q = np.clip(np.rint(xb / np.where(d > 0, d, np.float32(1))[..., None]), -127, 127)
    return q * (d > 0)[..., None], d


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> np.ndarray:
    """``sum_b d[b] * (q[b] . w[b])`` in fp64 (``w``: the dequantized matrix)."""
    q, d = quantize_x(x)
    wb = w.numpy().astype(np.float64).reshape(w.shape[0], -1, 32)
    y = (np.einsum("mbk,nbk->mnb", q.astype(np.float64), wb) * d[:, None, :].astype(np.float64)).sum(-1)
    return y + bias.numpy().astype(np.float64) if bias is not None else y


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    """How far rounding x to int8 can move each output at most: every element moves by at most
    half its block's step, so y[m][n] by at most sum_b d[m][b] / 2 * sum |w[n][b]|."""
    _, d = quantize_x(x)
    wb = np.abs(w.numpy().astype(np.float64)).reshape(w.shape[0], -1, 32).sum(-1)
    return 0.5 * d.astype(np.float64) @ wb.T


def relative(y: torch.Tensor, ref: np.ndarray | torch.Tensor) -> float:
    """Largest error of ``y`` against ``ref``, each row's relative to its max |ref|."""
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    return float((np.abs(y.numpy().astype(np.float64) - ref) / scale).max())


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_equals_the_int8_reference_and_stays_near_the_exact_path(native, qtype):
    n = 37  # off the 4-row units
    torch.manual_seed(0)
    for k in (256, 768):
        for raw in samples(qtype, n, k, seed=k):
            t = quant(qtype, raw, n, k)
            fast, exact = gguf_ops.gguf_linear([t], int8=True), gguf_ops.gguf_linear([t])
            assert fast is not None and fast.activations == "int8" and exact.activations == "fp32"
            assert fast.format == exact.format == qtype.name.lower()
            w = gguf_ops.dequantize(t)
            for m in (1, 2, 3, 5, 8, 11, 13, gguf_ops.int8_rows()):  # 11: two passes of the 16-lane code
                x = torch.randn(m, k)
                y = fast(x)
                assert relative(y, reference(x, w)) < 1e-5, (k, m)
                slack = 1e-5 * np.abs(reference(x, w)).max(axis=1, keepdims=True)  # fp32 sums
                assert (np.abs(y.numpy() - exact(x).numpy()) <= rounding_bound(x, w) + slack).all(), (k, m)


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_the_avx2_build_equals_the_int8_reference(avx2_only, qtype):
    """The 8-lane code (the only one on AVX2 CPUs; here built without AVX-512) to its own row limit."""
    rows = int(build.bind(avx2_only, "gguf_q8_rows", ctypes.c_int)())
    assert rows == 16
    n, k = 21, 512
    torch.manual_seed(1)
    t = quant(qtype, next(samples(qtype, n, k, seed=3)), n, k)
    lin, exact = gguf_ops.GGUFLinear(avx2_only, [t], None, int8=True), gguf_ops.GGUFLinear(avx2_only, [t], None)
    w = gguf_ops.dequantize(t)
    for m in (1, 3, 4, 9, rows):
        x = torch.randn(m, k)
        assert relative(lin(x), reference(x, w)) < 1e-5, m
    x = torch.randn(rows + 1, k)
    assert torch.equal(lin(x), exact(x))


def test_other_types_and_many_rows_are_the_exact_kernel(native):
    k = 512
    rng = np.random.default_rng(5)
    perm = torch.from_numpy(rng.permutation(21).astype(np.int32))
    parts = [quant(T.Q4_K, random_blocks(T.Q4_K, 21, k, rng), 21, k, rows=perm),
             quant(T.F16, random_blocks(T.F16, 10, k, rng), 10, k),
             quant(T.IQ4_NL, random_blocks(T.IQ4_NL, 7, k, rng), 7, k),
             quant(T.Q6_K, random_blocks(T.Q6_K, 9, k, rng), 9, k),
             quant(T.Q3_K, random_blocks(T.Q3_K, 6, k, rng), 6, k)]
    bias = torch.randn(53)
    fast, exact = gguf_ops.gguf_linear(parts, bias, int8=True), gguf_ops.gguf_linear(parts, bias)
    w = torch.cat([gguf_ops.dequantize(p) for p in parts])
    for m in (1, 4, 7):
        x = torch.randn(m, k)
        y, ref = fast(x), exact(x)
        assert torch.equal(y[:, 21:38], ref[:, 21:38]) and torch.equal(y[:, 47:], ref[:, 47:]), m
        q = torch.cat([torch.arange(21), torch.arange(38, 47)])
        assert relative(y[:, q], reference(x, w[q], bias[q])) < 1e-5, m
    x = torch.randn(gguf_ops.int8_rows() + 1, k)  # past the int8 path: the exact kernel for every part
    assert torch.equal(fast(x), exact(x))
    floats = quant(T.F32, random_blocks(T.F32, 5, 37, rng), 5, 37)  # K off the 32-blocks, nothing to quantize
    x = torch.randn(3, 37)
    assert torch.equal(gguf_ops.gguf_linear([floats], int8=True)(x), gguf_ops.gguf_linear([floats])(x))


def test_bias_and_thread_count(native):
    k = 1024
    rng = np.random.default_rng(6)
    parts = [quant(T.Q4_K, random_blocks(T.Q4_K, 70, k, rng), 70, k),
             quant(T.Q8_0, random_blocks(T.Q8_0, 30, k, rng), 30, k)]
    bias = torch.randn(100)
    lin = gguf_ops.gguf_linear(parts, bias, int8=True)
    plain = gguf_ops.gguf_linear(parts, int8=True)
    threads = torch.get_num_threads()
    try:
        for m in (1, 6):
            x = torch.randn(m, k)
            torch.set_num_threads(1)
            one = lin(x)
            torch.set_num_threads(2)
            assert torch.equal(lin(x), one)
            assert torch.equal(one, plain(x) + bias)
    finally:
        torch.set_num_threads(threads)


def test_zero_rows_and_blocks(native):
    k = 512
    rng = np.random.default_rng(7)
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0):
        t = quant(qtype, random_blocks(qtype, 9, k, rng), 9, k)
        lin, w = gguf_ops.gguf_linear([t], int8=True), gguf_ops.dequantize(t)
        for m in (3, 20):  # 20: the many-row code, rows of x in lanes
            x = torch.randn(m, k)
            x[0] = 0
            x[1, 32:64] = 0  # one all-zero block amid others
            x[2, :] = 1e-44  # d = max / 127 underflows to 0: treated as zeros
            y = lin(x)
            assert torch.isfinite(y).all() and not y[0].any() and not y[2].any()
            assert relative(y[1:2], reference(x[1:2], w)) < 1e-5
            assert m == 3 or relative(y[3:], reference(x[3:], w)) < 1e-5


def test_bf16_wins_only_with_tiles(native):
    t = quant(T.Q4_K, random_blocks(T.Q4_K, 4, 256, np.random.default_rng(8)), 4, 256)
    both = gguf_ops.gguf_linear([t], bf16=True, int8=True)
    assert both.activations == ("bf16" if gguf_ops.amx_available() else "int8")
