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
