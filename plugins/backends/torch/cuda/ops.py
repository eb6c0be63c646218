"""The paged-attention operators ``llmserve::paged_decode`` and ``llmserve::store_kv``.

Registered as torch custom operators so that one call site serves every device: Triton kernels
on CUDA (``triton_attention.py``), plain torch on the CPU (the reference the kernels are tested
against, and what a fake-graph run on the CPU uses), and shapes alone on the meta device (the
test that proves a graphed step free of host syncs runs there). Importing this module
registers them; it does not import Triton.
"""

from __future__ import annotations

import torch


def reference_decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, scale: float,
                     window: int) -> torch.Tensor:
    """Decode attention in torch: the gather-and-mask computation the kernels replace."""
    B, H, D = q.shape
    kvh, bs = kv.shape[0] // 2, kv.shape[2]
    W = table.shape[1]
    L = W * bs
    blocks = kv.index_select(1, table.reshape(-1).long()).view(2 * kvh, B, L, D).to(q.dtype)
    pos = torch.arange(L, device=q.device)[None, :]
    ctx_col = ctx.long()[:, None]
    allowed = pos < ctx_col
    if window > 0:
        allowed &= pos >= ctx_col - window
    # Unwritten slots may hold anything (NaN too): zero them so masked weights stay zero.
    blocks = blocks.masked_fill(~allowed[None, :, :, None], 0)
    keys, vals = blocks[:kvh], blocks[kvh:]                                  # [kvh, B, L, D]
    qd = q.reshape(B, kvh, H // kvh, D).transpose(0, 1)                      # [kvh, B, G, D]
    scores = torch.matmul(qd, keys.transpose(-1, -2)) * scale                # [kvh, B, G, L]
    scores = scores.masked_fill(~allowed[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), -1).nan_to_num_(0.0).to(vals.dtype)  # ctx 0: all zero
    return torch.matmul(probs, vals).transpose(0, 1).reshape(B, H, D).to(q.dtype)


@torch.library.custom_op("llmserve::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, scale: float,
                 window: int, segments: int) -> torch.Tensor:
    """Attention of decode rows ``q [B, H, D]`` over one layer's pool ``kv [2*kvh, blocks, bs, D]``:
    row ``b`` attends to the first ``ctx[b]`` positions of the blocks ``table[b]`` lists (the last
    ``window`` of them when ``window`` > 0). ``segments``: how many parts the CUDA kernel splits
    each context into (ignored elsewhere)."""
    return reference_decode(q, kv, table, ctx, scale, window)


@paged_decode.register_kernel("cuda")
def _paged_decode_cuda(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, scale: float,
                       window: int, segments: int) -> torch.Tensor:
    from .triton_attention import decode

    return decode(q, kv, table, ctx, scale, window, segments)


@paged_decode.register_fake
def _paged_decode_fake(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, scale: float,
                       window: int, segments: int) -> torch.Tensor:
    return q.new_empty(q.shape)


def reference_prefill(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                      starts: torch.Tensor, out: torch.Tensor, scale: float, window: int) -> None:
    """Prompt-chunk attention in torch, chunk by chunk over its gathered blocks."""
    import torch.nn.functional as F

    kvh, bs, D = kv.shape[0] // 2, kv.shape[2], kv.shape[3]
    group = q.shape[1] // kvh
    for s, (r, n, st) in enumerate(zip(rows.tolist(), lens.tolist(), starts.tolist())):
        ctx = st + n
        nb = -(-ctx // bs)
        blocks = kv.index_select(1, table[s, :nb].long()).reshape(2 * kvh, nb * bs, D)[:, :ctx].to(q.dtype)
        q_pos = torch.arange(st, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window > 0:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q[r:r + n].transpose(0, 1)[None], blocks[None, :kvh], blocks[None, kvh:],
                                           attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[r:r + n] = o[0].transpose(0, 1)


@torch.library.custom_op("llmserve::paged_prefill", mutates_args=("out",))
def paged_prefill(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                  starts: torch.Tensor, out: torch.Tensor, scale: float, window: int, longest: int) -> None:
    """Causal attention of prompt chunks that continue a cached prefix, into their rows of
    ``out [T, H, D]``: chunk ``s`` is ``lens[s]`` packed rows from ``rows[s]``, at positions
    ``starts[s] ..`` of the sequence whose blocks ``table[s]`` lists; keys and values (the
    chunk's own already stored) are read from one layer's pool ``kv``. ``longest``: the longest
    chunk (the CUDA kernel's grid)."""
    reference_prefill(q, kv, table, rows, lens, starts, out, scale, window)


@paged_prefill.register_kernel("cuda")
def _paged_prefill_cuda(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                        lens: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, scale: float, window: int,
                        longest: int) -> None:
    from .triton_attention import prefill

    prefill(q, kv, table, rows, lens, starts, out, scale, window, longest)


@paged_prefill.register_fake
def _paged_prefill_fake(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                        lens: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, scale: float, window: int,
                        longest: int) -> None:
    return None


@torch.library.custom_op("llmserve::store_kv", mutates_args=("kv_slots",))
def store_kv(kv_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the step's keys and values ``k``/``v [T, kvh, D]`` into one layer's pool viewed as
    ``kv_slots [2*kvh, slots, D]`` at ``slots [T]``; a negative slot (a padded row) is skipped."""
    keep = (slots >= 0).nonzero()[:, 0]
    rows = torch.cat((k[keep], v[keep]), 1).transpose(0, 1).to(kv_slots.dtype)
    kv_slots.index_copy_(1, slots[keep].long(), rows)


@store_kv.register_kernel("cuda")
def _store_kv_cuda(kv_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    from .triton_attention import store

    store(kv_slots, slots, k, v)


@store_kv.register_fake
def _store_kv_fake(kv_slots: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    return None


def decode_segments(rows: int, kv_heads: int, processors: int) -> int:
    """How many parts to split each decode row's context into so that ``rows x kv_heads``
    programs fill about twice the device's ``processors`` (1 once they do; at most 16)."""
    return max(1, min(16, (2 * processors) // max(1, rows * kv_heads)))


# -- the fused forward's small per-layer operations (``KernelOps``) ------------------------------

def _triton_shapes_ok(head_dim: int) -> bool:
    return head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0  # a power-of-two half


@torch.library.custom_op("llmserve::add_rms_norm", mutates_args=("h",))
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then RMSNorm of ``h`` scaled by ``weight`` (new tensor)."""
    from ..fused import TorchOps

    return TorchOps.add_rms_norm(h, delta, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from . import triton_elementwise

    return triton_elementwise.add_rms_norm(h, delta, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("llmserve::silu_mul", mutates_args=())
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[T, 2 * I]`` gate-and-up tensor -> ``[T, I]``."""
    from ..fused import TorchOps

    return TorchOps.silu_mul(gu)


@silu_mul.register_kernel("cuda")
def _silu_mul_cuda(gu: torch.Tensor) -> torch.Tensor:
    from . import triton_elementwise

    return triton_elementwise.silu_mul(gu)


@silu_mul.register_fake
def _silu_mul_fake(gu: torch.Tensor) -> torch.Tensor:
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _rope_store_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor | None,
                      slots: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int) -> None:
    from ..fused import TorchOps

    TorchOps.rope(qkv, heads + kv_heads, head_dim, cos, sin)
    if kv_slots is not None and slots is not None:
        k_end = (heads + kv_heads) * head_dim
        T = qkv.shape[0]
        k = qkv[:, heads * head_dim:k_end].view(T, kv_heads, head_dim)
        v = qkv[:, k_end:k_end + kv_heads * head_dim].view(T, kv_heads, head_dim)
        store_kv(kv_slots, slots, k, v)


@torch.library.custom_op("llmserve::rope_store", mutates_args=("qkv", "kv_slots"))
def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor | None,
               slots: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int) -> None:
    """RoPE ("rotate half") in place on the ``heads`` query and ``kv_heads`` key heads at the start
    of each ``qkv`` row, then, with ``kv_slots`` (one layer's pool as ``[2*kvh, slots, D]``), the
    rotated keys and the values that follow them stored at ``slots`` (negative: skipped)."""
    _rope_store_torch(qkv, cos, sin, kv_slots, slots, heads, kv_heads, head_dim)


@rope_store.register_kernel("cuda")
def _rope_store_cuda(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor | None,
                     slots: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int) -> None:
    if not _triton_shapes_ok(head_dim) or cos.stride(-1) != 1 or qkv.stride(-1) != 1:
        return _rope_store_torch(qkv, cos, sin, kv_slots, slots, heads, kv_heads, head_dim)
    from . import triton_elementwise

    triton_elementwise.rope_store(qkv, cos, sin, kv_slots, slots, heads, kv_heads, head_dim)


@rope_store.register_fake
def _rope_store_fake(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor | None,
                     slots: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int) -> None:
    return None


class KernelOps:
    """The fused forward's small operations as the operators above (one launch each on CUDA), with
    ``TorchOps``' methods plus ``rope_store``, which also writes the layer's keys and values
    (so the attention after it skips its own KV store)."""

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.llmserve.add_rms_norm(h, delta, weight, eps)

    @staticmethod
    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmserve.silu_mul(gu)

    @staticmethod
    def rope(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        torch.ops.llmserve.rope_store(x, cos, sin, None, None, heads, 0, head_dim)

    @staticmethod
    def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
        from ..fused import TorchOps

        return TorchOps.gelu_tanh_mul(gu)

    @staticmethod
    def qk_norm(x: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> None:
        from ..fused import TorchOps  # plain torch ops: few launches, once per layer

        TorchOps.qk_norm(x, heads, kv_heads, head_dim, q_weight, k_weight, eps)

    @staticmethod
    def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, kv_slots: torch.Tensor, slots: torch.Tensor) -> None:
        torch.ops.llmserve.rope_store(qkv, cos, sin, kv_slots, slots, heads, kv_heads, head_dim)
