"""GGUF linears read straight from quantized blocks: for every served type, the native row
dequantizer equals gguf's numpy ``dequantize`` bit for bit (random raw blocks and, where gguf can
quantize, quantized random data), and the linear equals ``x @ dequantize(W).T`` for few and many
rows, multi-part (mixed-type) layers, row permutations and biases; unserved types and K off the
block size are refused with a one-line error."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llmserve.plugins.backends.torch.native import build, gguf_ops
from llmserve.plugins.backends.torch.native.gguf_ops import QuantTensor

# Byte offsets of each block's fp16 scale fields (set to small finite values in random blocks).
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,),
               T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: ()}
_QUANTIZABLE = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
TYPES = [T(t) for t in gguf_ops.SUPPORTED]


@pytest.fixture(scope="module")
def native():
    """The native library, built (or found cached); a skip only where no compiler exists."""
    lib = build.library("gguf_linear", "GGUF linear-layer")
    if lib is None:
        if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
            pytest.skip("no C compiler here: the GGUF kernels cannot be built")
        pytest.fail("the GGUF kernel library failed to build although a compiler is present")
    return lib


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, row_bytes]`` valid raw blocks: random code bytes, small finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if qtype in (T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return (w.astype(np.float16) if qtype == T.F16 else (w.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16)
        scale[::7] = np.float16(6e-6)  # a subnormal fp16 scale now and then
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # a shared exponent byte (e8m0) per block: scales near 2^-6, and the two subnormal ones
        raw[:, 0] = rng.integers(116, 126, raw.shape[0], dtype=np.uint8)
        raw[::11, 0], raw[::13, 0] = 0, 1
    return raw.reshape(n, -1)


def quant(qtype: T, raw: np.ndarray, n: int, k: int, rows: torch.Tensor | None = None) -> QuantTensor:
    return QuantTensor(int(qtype), torch.from_numpy(np.ascontiguousarray(raw)), (n, k), rows)


def samples(qtype: T, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    yield random_blocks(qtype, n, k, rng)
    if qtype in _QUANTIZABLE:
        yield gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qtype).view(np.uint8)


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``y`` within fp32 summation-order error of ``x @ w.T (+ bias)`` (computed in fp64)."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, scale = ref + bias.double(), scale + bias.double().abs()
    err = (y.double() - ref).abs()
    assert bool((err <= 1e-5 * scale + 1e-30).all()), f"max error {float(err.max())} at scale {float(scale.max())}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_dequantizer_is_bit_exact(native, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 37, 2 * max(block, 32) + (5 if block == 1 else 0)  # float types: K off the 32-weight chunks too
    for raw in samples(qtype, n, k):
        t = quant(qtype, raw, n, k)
        ref = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        got = gguf_ops.gguf_rows(t, torch.arange(n)).numpy()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
        ids = torch.tensor([5, 0, 36, 5])
        assert np.array_equal(gguf_ops.gguf_rows(t, ids).numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_equals_matmul_on_dequantized(native, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 45, 3 * max(block, 32) + (7 if block == 1 else 0)  # N off every row group and panel width
    torch.manual_seed(0)
    for raw in samples(qtype, n, k, seed=1):
        t = quant(qtype, raw, n, k)
        w = gguf_ops.dequantize(t)
        lin = gguf_ops.gguf_linear([t])
        assert lin is not None and lin.kernel and lin.format == qtype.name.lower()
        assert (lin.out_features, lin.in_features) == (n, k)
        for m in (1, 3, 8, 33):
            x = torch.randn(m, k)
            check_close(lin(x), x, w)


@pytest.fixture(scope="module")
def avx2_only(native):
    """The same source built without AVX-512 (the baseline every AVX2 CPU runs): on CPUs with
    AVX-512 the default build takes the 16-wide few-row path instead."""
    lib = build.baseline_library("gguf_linear", "GGUF linear-layer")
    assert lib is not None
    return lib


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_baseline_equals_matmul_on_dequantized(avx2_only, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 21, 2 * max(block, 32) + (3 if block == 1 else 0)
    raw = next(samples(qtype, n, k, seed=2))
    t = quant(qtype, raw, n, k)
    lin = gguf_ops.GGUFLinear(avx2_only, [t], None)
    w = gguf_ops.dequantize(t)
    for m in (1, 2, 3, 4, 8, 9):
        x = torch.randn(m, k)
        check_close(lin(x), x, w)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K, T.F32], ids=lambda t: t.name)
def test_many_rows_are_bit_for_bit_the_avx2_baseline(native, avx2_only, qtype):
    """Past the few-row path both builds unpack the same fp32 panels; the AVX-512 register block
    keeps each output's k-ordered FMA chain, so the outputs are the AVX2 build's bits."""
    n, k = 45, 512
    t = quant(qtype, next(samples(qtype, n, k, seed=4)), n, k)
    bias = torch.randn(n)
    fast, base = gguf_ops.GGUFLinear(native, [t], bias), gguf_ops.GGUFLinear(avx2_only, [t], bias)
    for m in (13, 33, 100):
        x = torch.randn(m, k)
        assert torch.equal(fast(x), base(x)), m


def test_mixed_parts_rows_and_bias(native):
    k = 512
    rng = np.random.default_rng(3)
    perm = torch.from_numpy(rng.permutation(40).astype(np.int32))
    parts = [quant(T.Q4_K, random_blocks(T.Q4_K, 40, k, rng), 40, k, rows=perm),
             quant(T.Q6_K, random_blocks(T.Q6_K, 24, k, rng), 24, k),
             quant(T.Q4_K, random_blocks(T.Q4_K, 19, k, rng), 19, k)]
    bias = torch.randn(83)
    lin = gguf_ops.gguf_linear(parts, bias)
    assert lin is not None and lin.kernel and lin.format == "q4_k+q6_k" and lin.out_features == 83
    w = torch.cat([gguf_ops.dequantize(p) for p in parts])
    stored = gguf.quants.dequantize(parts[0].data.numpy(), T.Q4_K).reshape(40, k)
    assert torch.equal(w[:40], torch.from_numpy(stored[perm.numpy()]))  # output n is stored row perm[n]
    for m in (1, 2, 5, 8, 33):
        x = torch.randn(m, k)
        check_close(lin(x), x, w, bias)
    rows = gguf_ops.gguf_rows(parts[0], torch.tensor([3, 3, 0]))
    assert torch.equal(rows, w[[3, 3, 0]])


def test_unsupported_type_is_refused_in_one_line(native):
    raw = np.zeros((4, 66), dtype=np.uint8)
    t = QuantTensor(int(T.IQ2_XXS), torch.from_numpy(raw), (4, 256))
    with pytest.raises(ValueError) as err:
        gguf_ops.gguf_linear([t])
    msg = str(err.value)
    assert "IQ2_XXS" in msg and "Q4_K" in msg and "\n" not in msg
    assert msg == gguf_ops.unsupported_error(int(T.IQ2_XXS), "part 0")
    with pytest.raises(ValueError, match="IQ2_XXS"):
        gguf_ops.gguf_rows(t, torch.tensor([0]))


def test_k_off_the_block_size_is_refused(native):
    raw = np.zeros((4, 18 * 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="not a multiple of the Q4_0 block size 32"):
        gguf_ops.gguf_linear([QuantTensor(int(T.Q4_0), torch.from_numpy(raw), (4, 80))])
    with pytest.raises(ValueError, match="inputs"):  # parts must agree on K
        gguf_ops.gguf_linear([quant(T.Q8_0, np.zeros((2, 34), np.uint8), 2, 32),
                              quant(T.Q8_0, np.zeros((2, 68), np.uint8), 2, 64)])
