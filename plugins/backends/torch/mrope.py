"""Multimodal RoPE (the Qwen-VL families): positions along three axes, time, rows and columns.

A text token's three positions are equal; an image's tokens take the row and column of their
merged patch in its grid, all starting at the position the image starts at, and the text after an
image continues from the largest of them plus one. So a prompt's positions fall behind its token
indices by each image's tokens less its larger side (a 16 x 12 grid: 192 tokens, 16 positions),
and every later token, answers included, is shifted by the sum. The paged KV cache and the
attention keep token indices; only the rotary angles read these positions.

Each RoPE frequency reads one axis: which one is the model's own split (``mrope_section``,
contiguous for Qwen2/2.5-VL, interleaved for Qwen3-VL), learnt here by probing the model's rotary
module once rather than restated per family.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from llmserve import StepItem


def uses_mrope(model: Any) -> bool:
    """Whether the model's language model reads three-axis positions."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(cfg, "rope_parameters", None)
    return isinstance(rope, dict) and bool(rope.get("mrope_section"))


def frequency_axes(model: Any, rotary: Any, head_dim: int, device: torch.device) -> torch.Tensor | None:
    """``[head_dim]``: the axis (0 time, 1 rows, 2 columns) each rotary dimension of ``model``
    reads, from the config where it states them, else from its rotary module (None: its RoPE has one
    axis). Token k of the probe sits at position 1 on axis k and 0 on the others: the dimensions
    whose sine moves for it read axis k."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    stated = getattr(cfg, "mrope_axes", None)  # a GGUF file's sections (gguf_config.qwen_vl_config)
    if stated is not None:
        axes = torch.tensor(list(stated), dtype=torch.long, device=device)
        return torch.cat((axes, axes)) if axes.numel() * 2 == head_dim else axes
    if not uses_mrope(model):
        return None
    probe = torch.eye(3, dtype=torch.long, device=device)[:, None, :]  # [axis, batch 1, token]
    _, sin = rotary(torch.empty(1, device=device), probe)
    sin = sin[0]
    if sin.shape[-1] * 2 == head_dim:
        sin = torch.cat((sin, sin), -1)
    moved = sin != 0  # [token (= axis), D]
    return torch.where(moved[1], 1, torch.where(moved[2], 2, 0))


def combine(by_axis: Sequence[tuple[torch.Tensor, torch.Tensor]],
            axes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, D]`` from each axis's own cos/sin ``[T, D]``: dimension d from axis ``axes[d]``."""
    cos = torch.stack([c for c, _ in by_axis]).gather(0, axes.expand(1, by_axis[0][0].shape[0], -1))[0]
    sin = torch.stack([s for _, s in by_axis]).gather(0, axes.expand(1, by_axis[0][1].shape[0], -1))[0]
    return cos, sin


def item_positions(media: Sequence[Any], lo: int, hi: int) -> torch.Tensor:
    """``[3, hi - lo]``: the positions of token indices ``lo .. hi - 1`` of a prompt whose images
    are ``media`` (``MediaInput``, in prompt order, each ``data.grid`` its merged (t, h, w))."""
    shift = 0  # positions less token indices, after the images so far
    for m in media:  # those wholly before the range only shift it (every decode step's case)
        if m.end > lo:
            break
        shift += max(m.data.grid[1:]) - (m.end - m.start)
    out = torch.arange(lo + shift, hi + shift).expand(3, -1).clone()
    for m in media:
        if m.end <= lo:
            continue
        if m.start >= hi:
            break
        t, h, w = m.data.grid
        start = m.start + shift
        a, b = max(m.start, lo), min(m.end, hi)
        if a < b:
            j = torch.arange(a - m.start, b - m.start)
            out[0, a - lo:b - lo] = start + j // (h * w)
            out[1, a - lo:b - lo] = start + (j // w) % h
            out[2, a - lo:b - lo] = start + j % w
        after = shift + max(h, w) - (m.end - m.start)
        if m.end < hi:
            out[:, max(m.end, lo) - lo:] += after - shift
        shift = after
    return out


def step_positions(batch: list[StepItem], first_row: list[int], positions: torch.Tensor) -> torch.Tensor | None:
    """``[3, T]`` positions of a packed step, or None when no item has an image at or before its
    fed tokens (every position is then its token index)."""
    if not any(it.media for it in batch):
        return None
    out = positions.expand(3, -1).clone()
    for it, row in zip(batch, first_row):
        if it.media:
            n = len(it.token_ids)
            out[:, row:row + n] = item_positions(it.media, it.start_pos, it.start_pos + n).to(out.device)
    return out


def select_ropes(one: Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]], kinds: Sequence[Any],
                 positions: torch.Tensor, rope: torch.Tensor | None,
                 axes: torch.Tensor | None) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin per RoPE kind of the step's rows: ``one(positions, kind)``, or, with three-axis
    positions ``rope`` and the model's ``axes``, each dimension from its own axis."""
    if rope is None or axes is None:
        return {kind: one(positions, kind) for kind in kinds}
    return {kind: combine([one(rope[a], kind) for a in range(3)], axes) for kind in kinds}
