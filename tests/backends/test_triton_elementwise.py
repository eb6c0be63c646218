"""The fused forward's small operations as Triton kernels (in Triton's interpreter without a GPU)
against ``TorchOps``, the torch code they replace: residual add + RMSNorm, SiLU(gate) * up, and
RoPE on queries and keys with the KV store of the same launch."""

from __future__ import annotations

import os

import pytest
import torch

from llmserve.plugins.backends.torch.cuda import ops
from llmserve.plugins.backends.torch.cuda import triton_elementwise as te
from llmserve.plugins.backends.torch.fused import TorchOps

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on the kernels' device (a copy on the CPU too: a kernel must not write the original)."""
    return t.to(DEVICE, copy=True)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    else:  # one bf16 step at most, from a different summation order or rsqrt
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 200, generator=gen).to(dtype)      # rows with a stride wider than the hidden size
    h, delta = wide[:, :96], torch.randn(5, 96, generator=gen).to(dtype) if with_delta else None
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    h_ref = h.clone()
    want = TorchOps.add_rms_norm(h_ref, delta, w, 1e-6)
    on = dev(wide)
    got = te.add_rms_norm(on[:, :96], dev(delta) if delta is not None else None, dev(w), 1e-6)
    close(got, want, dtype)
    close(on[:, :96], h_ref, dtype)          # the residual stream was updated in place
    assert torch.equal(on[:, 96:].cpu(), wide[:, 96:])  # and nothing beside it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gu = torch.randn(3, 2 * 80, generator=torch.Generator().manual_seed(2)).to(dtype)
    close(te.silu_mul(dev(gu)), TorchOps.silu_mul(gu), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store(dtype):
    T, H, kvh, D, slots_n = 4, 4, 2, 16, 40
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * kvh) * D, generator=gen).to(dtype)
    ang = torch.rand(T, D // 2, generator=gen) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    slots = torch.tensor([7, -1, 30, 2], dtype=torch.int32)
    pool = torch.zeros(2 * kvh, slots_n, D, dtype=dtype)
    want_qkv, want_pool = qkv.clone(), pool.clone()
    ops._rope_store_torch(want_qkv, cos, sin, want_pool, slots, H, kvh, D)
    got_qkv, got_pool = dev(qkv), dev(pool)
    te.rope_store(got_qkv, dev(cos), dev(sin), got_pool, dev(slots), H, kvh, D)
    close(got_qkv, want_qkv, dtype)
    close(got_pool, want_pool, dtype)
    assert int((got_pool.cpu() != 0).any(-1).any(0).sum()) == 3   # three rows stored, the padded one not
    only = dev(qkv)
    te.rope_store(only, dev(cos), dev(sin), None, None, H + kvh, 0, D)   # RoPE alone
    close(only, want_qkv, dtype)


def test_kernel_ops_cpu_path_is_the_torch_code():
    gen = torch.Generator().manual_seed(4)
    h, d, w = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen), torch.rand(32, generator=gen)
    h2 = h.clone()
    assert torch.equal(ops.KernelOps.add_rms_norm(h, d, w, 1e-5), TorchOps.add_rms_norm(h2, d, w, 1e-5))
    assert torch.equal(h, h2)
    gu = torch.randn(3, 64, generator=gen)
    assert torch.equal(ops.KernelOps.silu_mul(gu), TorchOps.silu_mul(gu))
