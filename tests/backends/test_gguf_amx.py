"""The opt-in bf16 path of the GGUF linears (``gguf_linear(..., bf16=True)``, AMX tiles), for every
served type, mixed-type parts, permuted rows and a bias, across several tiles of rows:

- 5 to SPLIT_ROWS rows of x (decode batches): ``x @ bf16(dequantize(W)).T``, the activations
  carried to about 16 bits as two bf16, so only the weights are rounded;
- more rows (prefill): ``x @ dequantize(W).T`` to about 2^-16 relative, weights split too;
- up to four rows: Q4_K and Q6_K parts ``bf16(x) @ dequantize(W).T`` (exact weights), every other
  type the exact fp32 kernel bit for bit, as are float weights whose K is not a multiple of 32.

Skipped only on CPUs without AMX-BF16 (the option is then ignored, as the last test shows)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES

from llmserve.plugins.backends.torch.native import gguf_ops

import test_gguf_kernels as kernels
from test_gguf_kernels import TYPES, T, quant, random_blocks

native = kernels.native  # the library fixture
amx = pytest.mark.skipif("not gguf_ops.amx_available()", reason="this CPU has no AMX-BF16 tiles")
SPLIT_ROWS = 32  # gguf_linear.c: more rows than this split the weights into two bf16 as well


def product(x: torch.Tensor, w: torch.Tensor,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ w.T (+ bias)`` in fp64, and the scale of its summation error."""
    xd, wd = x.double(), w.double()
    ref, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        ref, scale = ref + bias.double(), scale + bias.double().abs()
    return ref, scale


def amx_reference(x: torch.Tensor, w: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the tiles compute for ``len(x)`` rows: weights rounded to bf16 up to SPLIT_ROWS rows."""
    return product(x, w if len(x) > SPLIT_ROWS else w.bfloat16(), bias)


def within(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> bool:
    return bool(((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all())


@amx
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batches_equal_the_bf16_product(native, qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    n, k = 40, max(block, 256)  # 40 outputs: two full groups of 16 and a partial one
    rng = np.random.default_rng(1)
    q = quant(qtype, random_blocks(qtype, n, k, rng), n, k)
    fast, exact = gguf_ops.gguf_linear([q], bf16=True), gguf_ops.gguf_linear([q])
    w = gguf_ops.dequantize(q)
    for m in (5, 16, 32, 33, 70):  # 70 rows: five tiles of x, more than one pass over each panel
        x = torch.randn(m, k)
        y = fast(x)
        ref, scale = amx_reference(x, w)
        assert within(y, ref, scale), f"{m} rows: max error {float((y.double() - ref).abs().max())}"
        # the check tells the paths apart: rounding x too (or, up to SPLIT_ROWS, not rounding W)
        # is far from the tiles' result
        assert not within(product(x.bfloat16(), w.bfloat16())[0], ref, scale)
        if m <= SPLIT_ROWS and qtype != T.BF16:  # bf16 weights round to themselves
            assert not within(exact(x), ref, scale)


@amx
def test_a_long_prompt_is_taken_in_blocks_of_rows(native):
    """With K = 8192 a block of x's tiles is four (64 rows): 150 rows take three blocks, every
    panel rebuilt for each, and every row still gets the product."""
    rng = np.random.default_rng(6)
    n, k = 24, 8192
    q = quant(T.Q4_K, random_blocks(T.Q4_K, n, k, rng), n, k)
    x = torch.randn(150, k)
    ref, scale = amx_reference(x, gguf_ops.dequantize(q))
    assert within(gguf_ops.gguf_linear([q], bf16=True)(x), ref, scale)


@amx
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_few_rows_of_k_quants_take_exact_weights_and_bf16_activations(native, qtype, m):
    rng = np.random.default_rng(2)
    q = quant(qtype, random_blocks(qtype, 24, 512, rng), 24, 512)
    w = gguf_ops.dequantize(q)
    x = torch.randn(m, 512)
    ref, scale = x.bfloat16().double() @ w.double().T, x.bfloat16().double().abs() @ w.double().abs().T
    assert within(gguf_ops.gguf_linear([q], bf16=True)(x), ref, scale)
    assert not within(gguf_ops.gguf_linear([q])(x), ref, scale)


@amx
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_K, T.F16], ids=lambda t: t.name)
def test_few_rows_of_other_types_stay_exact(native, qtype):
    rng = np.random.default_rng(5)
    q = quant(qtype, random_blocks(qtype, 24, 512, rng), 24, 512)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, 512)
        assert torch.equal(gguf_ops.gguf_linear([q], bf16=True)(x), gguf_ops.gguf_linear([q])(x))


@amx
def test_mixed_parts_permuted_rows_and_bias(native):
    rng = np.random.default_rng(3)
    k = 512
    parts = [quant(T.Q4_K, random_blocks(T.Q4_K, 48, k, rng), 48, k,
                   torch.randperm(48, generator=torch.Generator().manual_seed(0)).to(torch.int32)),
             quant(T.Q6_K, random_blocks(T.Q6_K, 20, k, rng), 20, k),
             quant(T.Q8_0, random_blocks(T.Q8_0, 7, k, rng), 7, k)]
    bias = torch.randn(75)
    fast = gguf_ops.gguf_linear(parts, bias, bf16=True)
    w = torch.cat([gguf_ops.dequantize(p) for p in parts])
    for m in (8, 37):
        x = torch.randn(m, k)
        ref, scale = amx_reference(x, w, bias)
        assert within(fast(x), ref, scale)
    # three rows: the Q4_K and Q6_K parts from bf16 activations, the Q8_0 part exact
    x = torch.randn(3, k)
    y, exact = fast(x), gguf_ops.gguf_linear(parts, bias)(x)
    xb = x.bfloat16().double()
    ref, scale = xb @ w[:68].double().T + bias[:68].double(), xb.abs() @ w[:68].double().abs().T
    assert within(y[:, :68], ref, scale) and not torch.equal(y[:, :68], exact[:, :68])
    assert torch.equal(y[:, 68:], exact[:, 68:])


@amx
def test_float_weights_off_the_block_size_stay_exact(native):
    w = torch.randn(20, 40)  # K = 40: not a multiple of the 32-wide tile step
    q = gguf_ops.QuantTensor(int(T.F32), w.view(torch.uint8).reshape(20, -1), (20, 40))
    x = torch.randn(9, 40)
    assert torch.equal(gguf_ops.gguf_linear([q], bf16=True)(x), gguf_ops.gguf_linear([q])(x))


def test_without_amx_the_option_is_the_exact_kernel(native, monkeypatch):
    monkeypatch.setattr(gguf_ops, "amx_available", lambda: False)
    rng = np.random.default_rng(4)
    q = quant(T.Q8_0, random_blocks(T.Q8_0, 16, 256, rng), 16, 256)
    x = torch.randn(12, 256)
    assert torch.equal(gguf_ops.gguf_linear([q], bf16=True)(x), gguf_ops.gguf_linear([q])(x))
