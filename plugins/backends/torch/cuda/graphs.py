"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once over
persistent step buffers, the step's inputs filled from pinned staging by one copy.

A graph replays the exact kernels it recorded, on the exact tensors: so every input lives in one
flat int32 device buffer (token ids, positions, slots, context lengths, then the block table,
``[max_seqs, width]``), each section a fixed view that the captured forward reads. A step writes
its rows into the pinned twin of that buffer, pads the bucket's spare rows (slot -1: the KV store
skips them; context 0: attention writes zeros) and copies the used prefix over with one
non-blocking copy. Everything between that copy and the logits is on the device: the graphed
region holds no host sync (tests/backends/test_decode_graphs.py proves it on the meta device).

``capture`` is the graph backend: ``cuda_capture`` records a ``torch.cuda.CUDAGraph`` in a pool
shared by every bucket (captured largest first, so smaller ones reuse its memory);
``eager_capture`` re-runs the function on replay, which is what the CPU tests drive to check the
bookkeeping (buffers, padding, buckets) against eager steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from ..attention import StepMetadata

log = logging.getLogger("llmserve.backend.torch")

Forward = Callable[[torch.Tensor, torch.Tensor, StepMetadata], torch.Tensor]
Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def buckets(max_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 up to ``max_seqs`` (and itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_seqs] + list(range(16, max_seqs + 1, 16))
    return sorted(set(sizes) | {max_seqs})


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in graph: replay runs ``fn`` again and writes into the first run's output."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


def cuda_capture_in(pool: Any) -> Capture:
    """A ``Capture`` that records CUDA graphs into the memory pool ``pool``."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        fn()  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """Graphed decode steps of ``forward`` (input ids, positions, metadata -> logits ``[B, V]``).

    ``width`` is the block table's row length (the context limit in blocks): a step whose
    context is longer, whose batch is larger than the largest bucket, or which is not all
    decode rows runs eagerly instead (``fits`` says which).
    """

    def __init__(self, forward: Forward, max_seqs: int, width: int, block_size: int, device: torch.device,
                 segments: Callable[[int], int]) -> None:
        self.forward, self.width, self.block_size = forward, width, block_size
        self.buckets = buckets(max_seqs)
        self.max_seqs = self.buckets[-1]
        n = self.max_seqs
        self._size = 4 * n + n * width
        self.device_buf = torch.zeros(self._size, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.staging = torch.zeros(self._size, dtype=torch.int32, pin_memory=pinned)
        self._host = self.staging.numpy()
        self._segments = segments
        self._graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.replayed = 0  # steps run from a graph (the engine bench reports the share)

    def _views(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        n = self.max_seqs
        ids, pos, slots, ctx = (buf[i * n:i * n + rows] for i in range(4))
        table = buf[4 * n:].view(n, self.width)[:rows]
        meta = StepMetadata(slot_mapping=slots, num_decode=rows, decode_ctx=ctx, decode_table=table,
                            segments=self._segments(rows))
        return ids, pos, meta

    def capture(self, capture: Capture) -> None:
        """Record every bucket's graph (largest first) with all rows padded."""
        started = time.perf_counter()
        self._pad(0, self.max_seqs)
        self.device_buf.copy_(self.staging)
        for rows in reversed(self.buckets):
            ids, pos, meta = self._views(self.device_buf, rows)
            self._graphs[rows] = capture(lambda ids=ids, pos=pos, meta=meta: self.forward(ids, pos, meta))
        log.info("decode graphs: %d batch sizes up to %d captured in %.1f s", len(self._graphs), self.max_seqs,
                 time.perf_counter() - started)

    def fits(self, batch: list[Any]) -> bool:
        """Whether a step of these ``StepItem``s can replay a graph: only decode rows, each
        sampled, no prompt logprobs, within the largest bucket and the table's width."""
        if not self._graphs or len(batch) > self.max_seqs:
            return False
        limit = self.width * self.block_size
        return all(len(it.token_ids) == 1 and it.sample and it.prompt_logprob_targets is None
                   and it.start_pos < limit for it in batch)

    def _pad(self, start: int, stop: int) -> None:
        n, h = self.max_seqs, self._host
        h[start:stop] = 0
        h[n + start:n + stop] = 0
        h[2 * n + start:2 * n + stop] = -1
        h[3 * n + start:3 * n + stop] = 0

    def run(self, batch: list[Any]) -> torch.Tensor:
        """Logits ``[len(batch), V]`` of one decode step (the KV of every row written)."""
        rows = len(batch)
        bucket = next(b for b in self.buckets if b >= rows)
        n, h, bs, w = self.max_seqs, self._host, self.block_size, self.width
        table = h[4 * n:].reshape(n, w)
        for i, it in enumerate(batch):
            p = it.start_pos
            h[i], h[n + i] = it.token_ids[0], p
            h[2 * n + i] = it.block_table[p // bs] * bs + p % bs
            h[3 * n + i] = p + 1
            used = p // bs + 1
            table[i, :used] = it.block_table[:used]
        self._pad(rows, bucket)
        # One copy: the four sections whole, then only the table's used rows.
        span = 4 * n + bucket * w
        self.device_buf[:span].copy_(self.staging[:span], non_blocking=True)
        replay, out = self._graphs[bucket]
        replay()
        self.replayed += 1
        return out[:rows]
