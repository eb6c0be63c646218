"""Packing one engine step for the torch backend's forward: decode rows first, then prefill
chunks, into flat input ids, positions and the paged attention's metadata."""

from __future__ import annotations

from functools import partial

import torch

from llmserve import StepItem

from .attention import PagedKVCache, PrefillSegment, StepMetadata


def pack_batch(cache: PagedKVCache, device: torch.device, batch: list[StepItem],
               every_row: bool = True) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
    """Pack the batch (decode items first, then prefill chunks) into flat CPU lists, then tensors.

    Returns input ids, positions, the attention metadata and each item's first packed row.
    ``every_row=False``: the caller reads only the rows it samples or scores (``read_rows``).
    """
    bs, null = cache.block_size, cache.null_block
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    first_row = [0] * len(batch)
    # Decode rows: one per single-token item, and one per token of an item verifying proposals
    # (each attends to the positions up to its own, the tokens before it written in this step).
    decode = [i for i, it in enumerate(batch) if len(it.token_ids) == it.num_draft_tokens + 1]
    prefill = [i for i, it in enumerate(batch) if len(it.token_ids) != it.num_draft_tokens + 1]
    dec_blocks: list[int] = []
    dec_ctx: list[int] = []
    fresh: list[int] = []
    max_blocks = max(((batch[i].start_pos + len(batch[i].token_ids) - 1) // bs + 1 for i in decode), default=0)
    for i in decode:
        it = batch[i]
        table = it.block_table
        first_row[i] = len(ids)
        for p, token in enumerate(it.token_ids, it.start_pos):
            ids.append(token)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if p % bs == 0:
                fresh.append(table[p // bs])
            nb = p // bs + 1
            dec_blocks += table[:nb]
            dec_blocks += [null] * (max_blocks - nb)
            dec_ctx.append(p + 1)
    segments: list[PrefillSegment] = []
    cached: list[tuple[int, int, int, list[int]]] = []  # chunks continuing a prefix (kernel operators)
    native_chunks: list[tuple[int, int, int, list[int]]] = []  # every chunk (native CPU prefill kernel)
    wide: list[tuple[int, int, int]] = []  # packed rows lo .. hi - 1 that see keys up to a position (native)
    for i in prefill:
        it = batch[i]
        n, s, table = len(it.token_ids), it.start_pos, it.block_table
        first_row[i] = len(ids)
        ids += it.token_ids
        pos += range(s, s + n)
        slots += [table[p // bs] * bs + p % bs for p in range(s, s + n)]
        fresh += table[-(-s // bs): (s + n - 1) // bs + 1]  # blocks whose slot 0 is written now
        spans = both_ways(it, s, n)
        blocks = None
        if cache.prefill_kernel is not None:  # the native kernel reads every chunk's context in place
            native_chunks.append((first_row[i], n, s, table[: (s + n - 1) // bs + 1]))
            wide += [(first_row[i] + max(a, s) - s, first_row[i] + b - s, b - 1) for a, b in spans]
            continue
        if s > 0 and cache.kernel_ops and not spans:  # the prefill operator reads the cached prefix in place
            cached.append((first_row[i], n, s, table[: (s + n - 1) // bs + 1]))
            continue
        if s > 0:  # attends to cached positions: gather the sequence's blocks
            blocks = torch.tensor(table[: (s + n - 1) // bs + 1], dtype=torch.long).to(device, non_blocking=True)
        segments.append(PrefillSegment(row=first_row[i], n=n, start=s, blocks=blocks, spans=spans))
    rows = len(dec_ctx)
    if len(dec_blocks) and len(dec_blocks) != rows * max_blocks:
        raise ValueError("a decode item's block_table is shorter than its context")

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    key_end = None
    if wide:  # each row's last key: its own position, or the end of the run it attends to both ways
        limits = list(pos)
        for lo, hi, last in wide:
            limits[lo:hi] = [last] * (hi - lo)
        key_end = torch.tensor(limits, dtype=torch.long)
    meta = StepMetadata(slot_mapping=t(slots), num_decode=rows, prefills=segments,
                        prefill_plan=cache.plan_prefill(native_chunks, key_end))
    if cached:
        width = max(len(c[3]) for c in cached)
        meta.cached_prefill = tuple(torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True) for v in (
            [c[3] + [null] * (width - len(c[3])) for c in cached], [c[0] for c in cached],
            [c[1] for c in cached], [c[2] for c in cached])) + (max(c[1] for c in cached),)
    if fresh:
        meta.fresh_blocks = t(fresh)
    if decode and cache.kernel_ops:
        meta.decode_table = torch.tensor(dec_blocks, dtype=torch.int32).view(rows, max_blocks).to(
            device, non_blocking=True)
        meta.decode_ctx = torch.tensor(dec_ctx, dtype=torch.int32).to(device, non_blocking=True)
        meta.segments = cache.decode_segments(rows)
    elif decode:
        meta.decode_blocks, meta.decode_ctx, meta.decode_max_blocks = t(dec_blocks), t(dec_ctx), max_blocks
    if not every_row:
        meta.read_rows = partial(read_rows, cache, device, batch, first_row, len(ids))
    return t(ids), t(pos), meta, first_row


def read_rows(cache: PagedKVCache, device: torch.device, batch: list[StepItem], first_row: list[int],
              total: int) -> tuple[torch.Tensor, StepMetadata] | None:
    """The packed rows the runner reads (each sampling item's last row and the rows of its
    proposals, each scored prompt row) and attention metadata for them alone, every one a decode
    row over the positions up to its own (their keys are in the cache by then: written by earlier
    layers); None when that is every row, or a chunk holds tokens that attend both ways."""
    bs, null = cache.block_size, cache.null_block
    rows: list[int] = []
    for i, it in enumerate(batch):
        if it.media and any(m.bidirectional for m in it.media):
            return None
        n = len(it.token_ids)
        picked = set(range(n - it.num_draft_tokens - 1, n)) if it.sample else set()
        picked |= set(range(len(it.prompt_logprob_targets or ())))
        rows += sorted(first_row[i] + r for r in picked)
    if len(rows) == total:
        return None
    item_of = {first_row[i] + r: (it, it.start_pos + r) for i, it in enumerate(batch) for r in range(len(it.token_ids))}
    width = max((item_of[r][1] // bs + 1 for r in rows), default=0)
    blocks: list[int] = []
    ctx: list[int] = []
    for r in rows:
        it, p = item_of[r]
        blocks += it.block_table[:p // bs + 1] + [null] * (width - p // bs - 1)
        ctx.append(p + 1)
    meta = StepMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device=device), num_decode=len(rows))
    if cache.kernel_ops:
        meta.decode_table = torch.tensor(blocks, dtype=torch.int32).view(len(rows), width).to(device)
        meta.decode_ctx = torch.tensor(ctx, dtype=torch.int32).to(device)
        meta.segments = cache.decode_segments(len(rows))
    elif rows:
        meta.decode_blocks = torch.tensor(blocks, dtype=torch.long).to(device)
        meta.decode_ctx = torch.tensor(ctx, dtype=torch.long).to(device)
        meta.decode_max_blocks = width
    return torch.tensor(rows, dtype=torch.long).to(device), meta


def both_ways(item: StepItem, start: int, n: int) -> list[tuple[int, int]]:
    """The runs of positions of ``item``'s images (``MediaInput.bidirectional``) that its chunk of
    ``n`` positions from ``start`` feeds: their tokens attend to each other both ways. The
    scheduler never ends a chunk inside one (``chunk_end``); a step that would is refused, as its
    tokens would miss keys that are not written yet."""
    spans = [(a, b) for m in item.media for a, b in m.bidirectional if a < start + n and b > start]
    if any(b > start + n for _, b in spans):
        raise RuntimeError("a prefill chunk ends inside an image whose tokens attend to each other both ways")
    return spans
