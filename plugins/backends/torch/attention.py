"""Paged KV cache and the attention function transformers calls per layer: one packed forward
per engine step over many sequences (prefill chunks and decode tokens) with KV in a block pool."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

ATTN_IMPL = "llmserve_paged"
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The 8-bit cache (int8 codes, an fp32 scale per 32, ``native/csrc/paged_decode_q8.c``), under
# the names users know an 8-bit cache by from llama.cpp (q8_0) and vLLM (fp8).
INT8_NAMES = ("int8", "q8_0", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_dtype(name: str | None, compute: torch.dtype) -> torch.dtype:
    """The dtype ``--kv-cache-dtype name`` keeps keys and values in; ``auto`` is the model's
    compute dtype, every 8-bit name ``torch.int8``."""
    name = (name or "auto").lower()
    if name == "auto":
        return compute
    if name in INT8_NAMES:
        return torch.int8
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported KV-cache dtype {name!r}; use auto, float32, bfloat16, float16 or int8")
    return KV_DTYPES[name]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached row (a position of a KV head): an int8 row carries one fp32 scale
    per 32 codes after its ``head_dim`` codes."""
    return head_dim + 4 * -(-head_dim // 32) if dtype == torch.int8 else head_dim


class PagedKVCache:
    """Per layer one key and one value pool shaped ``[kv_heads, num_blocks + 1, block_size, head_dim]``.

    Heads come first so that gathering a sequence's blocks along dim 1 yields ``[kv_heads, L,
    head_dim]`` with contiguous rows, the layout attention wants, without a transpose copy.
    Block ``num_blocks`` is a zeroed "null" block that padding points at; other blocks are
    zeroed when a sequence starts filling them (see ``zero_blocks``).

    ``dtype`` is the cache's own dtype (``--kv-cache-dtype``), which may differ from the model's:
    keys and values are cast to it when written and back to the queries' dtype when read. An
    int8 cache keeps each row as ``head_dim`` codes and an fp32 scale per 32 of them
    (``row_width``: the pool's last dimension is wider than ``head_dim``), written and read only by the native kernels,
    so it needs them (a CPU model computing in fp32); elsewhere it is refused with ValueError.
    ``native``: decode attention, prefill attention and the KV write in the native CPU kernels
    where they apply (on the CPU: decode and the write for an fp32 cache, prefill for an fp32 or
    bf16 one; the caller passes False unless the model computes in fp32);
    ``matmul_decode``: the torch decode path on the CPU as plain matmuls (measured faster than
    SDPA there) instead of ``scaled_dot_product_attention``.
    ``kernel_ops``: the KV write and decode attention through the ``llmserve::store_kv`` and
    ``llmserve::paged_decode`` operators (``cuda/ops.py``): Triton kernels that read the pools in
    place on CUDA, their torch reference elsewhere. They read written positions only.
    ``shapes``: per pool layer its own ``(kv_heads, head_dim)`` (Gemma 4's global layers keep
    fewer, wider heads than its sliding ones; ``kv_layout.py``); None: ``kv_heads``/``head_dim`` for
    every layer. Layers of different shapes share one flat allocation, each a contiguous
    ``[2 * kv_heads, num_blocks + 1, block_size, width]`` view of its own part, so every kernel
    reads a layer exactly as it reads a layer of a uniform pool.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, native: bool = True,
                 matmul_decode: bool = True, kernel_ops: bool = False,
                 shapes: list[tuple[int, int]] | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.shapes = list(shapes) if shapes else [(kv_heads, head_dim)] * num_layers
        if len(self.shapes) != num_layers:
            raise ValueError(f"{len(self.shapes)} layer shapes for {num_layers} cache layers")
        # Model layer number -> pool layer, for a model whose other layers keep no keys and values
        # (a hybrid's recurrent layers; ``recurrent.RecurrentStates.kv_layers``). None: the same.
        self.layer_of: dict[int, int] | None = None
        if dtype == torch.int8 and not (native and device.type == "cpu" and not kernel_ops):
            raise ValueError("the int8 KV cache is read by the native CPU kernels only: it needs a CPU model "
                             "computing in float32 with the kernels on (elsewhere use --kv-cache-dtype bfloat16)")
        self.null_block = num_blocks
        # torch.empty: on CPU the pages are only committed when a block is first written.
        if len(set(self.shapes)) <= 1:
            width = row_width(head_dim, dtype)
            self.pool = torch.empty(num_layers, 2, kv_heads, num_blocks + 1, block_size, width,
                                    dtype=dtype, device=device)
            self.pool[:, :, :, num_blocks].zero_()
            parts = list(self.pool)
        else:
            sizes = [2 * h * (num_blocks + 1) * block_size * row_width(d, dtype) for h, d in self.shapes]
            self.pool = torch.empty(sum(sizes), dtype=dtype, device=device)
            parts = list(self.pool.split(sizes))
        # Per-layer views built once. Keys and values of a layer are adjacent, so one op writes
        # or gathers both: "blocks" [2*kvh, N+1, bs, D] and "slots" [2*kvh, (N+1)*bs, D].
        self.layers = [(kv.view(2 * h, num_blocks + 1, block_size, row_width(d, dtype)),
                        kv.view(2 * h, -1, row_width(d, dtype))) for kv, (h, d) in zip(parts, self.shapes)]
        if self.pool.dim() == 1:
            for blocks_view, _ in self.layers:
                blocks_view[:, num_blocks].zero_()
        self._work = torch.empty(0, dtype=dtype, device=device)
        # Decode attention read straight from the blocks (CPU fp32), prefill attention likewise
        # (CPU, fp32 queries, an fp32 or bf16 pool); None keeps the torch path.
        self.decode_kernel = self.write_kv = self.prefill_kernel = None
        self.matmul_decode = matmul_decode
        self.kernel_ops = kernel_ops
        self.processors = (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else 1)
        if kernel_ops:
            from .cuda.ops import decode_segments  # importing it registers the operators

            self.decode_segments = lambda rows: decode_segments(rows, kv_heads, self.processors)
        elif native and device.type == "cpu":
            from .native.ops import PREFILL_POOL_DTYPES, decode_kernel, kv_writer, prefill_kernel

            if dtype in (torch.float32, torch.int8):
                self.decode_kernel = decode_kernel(int8=dtype == torch.int8)
                # The KV write in the same library: one call per layer instead of cat + transpose +
                # index_copy_ (about 6 ms of a batch-32 step over 30 layers).
                self.write_kv = kv_writer(int8=dtype == torch.int8)
            if dtype in PREFILL_POOL_DTYPES:
                self.prefill_kernel = prefill_kernel()
            if dtype == torch.int8 and None in (self.decode_kernel, self.write_kv, self.prefill_kernel):
                raise ValueError("the int8 KV cache needs the native CPU kernels, which could not be built here "
                                 "(is a C compiler installed?)")

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        shapes: list[tuple[int, int]] | None = None) -> int:
        per_token = sum(2 * h * row_width(d, dtype) for h, d in shapes or [(kv_heads, head_dim)] * num_layers)
        return per_token * block_size * dtype.itemsize

    def plan_prefill(self, chunks: list[tuple[int, int, int, list[int]]], key_end: torch.Tensor | None = None) -> Any:
        """The step's prompt chunks (first row, length, first position, block table) for the
        native prefill kernel (``native.ops.PrefillPlan``), or None when it does not run here;
        ``key_end``: per packed row the last key position it sees (None: its own, causal)."""
        if self.prefill_kernel is None or not chunks:
            return None
        from .native.ops import PrefillPlan

        return PrefillPlan(chunks, self.block_size, self.null_block, key_end)

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Clear blocks a sequence starts writing (all layers, one op).

        The torch decode path reads whole blocks and masks the unwritten tail; masking cannot
        undo NaN/inf garbage left in that tail by the allocator (NaN * 0 = NaN), zeros it can.
        The native decode kernel and the kernel operators read only written positions (as does
        prefill, which slices gathered blocks to the context), so with them there is nothing to clear.
        """
        if self.decode_kernel is not None or self.kernel_ops:
            return
        if self.pool.dim() > 1:
            self.pool.index_fill_(3, blocks, 0)
        else:
            for blocks_view, _ in self.layers:
                blocks_view.index_fill_(1, blocks, 0)

    def gather(self, blocks_view: torch.Tensor, blocks: torch.Tensor,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` as two ``[kv_heads, len(blocks) * block_size, head_dim]`` views,
        in ``dtype`` (the attention's compute dtype) when given: a cache kept in another dtype is
        cast once per read, the gathered blocks only, never the pool.

        Gathers into a workspace reused by every layer and step: a fresh multi-MB tensor per layer
        costs page faults on CPU that are slower than the copy itself.
        """
        two_kvh, _, _, D = blocks_view.shape  # this layer's own shape (``shapes``)
        need = two_kvh * blocks.numel() * self.block_size * D
        if self._work.numel() < need:
            self._work = torch.empty(need + need // 2, dtype=self.pool.dtype, device=self.pool.device)
        out = self._work[:need].view(two_kvh, blocks.numel(), self.block_size, D)
        torch.index_select(blocks_view, 1, blocks, out=out)
        if dtype is not None and dtype != out.dtype:
            out = out.to(dtype)
        kv = out.view(2, two_kvh // 2, -1, D)
        return kv[0], kv[1]


@dataclass
class PrefillSegment:
    """A prompt chunk of one sequence: packed rows ``row .. row + n - 1``, positions ``start ..``."""

    row: int
    n: int
    start: int
    blocks: torch.Tensor | None = None  # block ids covering 0..start+n-1; None when start == 0
    # Runs of positions (a, b) whose tokens attend to each other both ways (an image's, Gemma 3).
    spans: list[tuple[int, int]] = field(default_factory=list)
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Bool ``[n, ctx]`` (True = attend), or None when plain causal attention over the chunk works."""
        if window not in self._masks:
            ctx = self.start + self.n
            if self.start == 0 and (window is None or window >= self.n) and not self.spans:
                self._masks[window] = None
            else:
                q_pos = torch.arange(self.start, ctx, device=device)[:, None]
                k_pos = torch.arange(ctx, device=device)[None, :]
                m = k_pos <= q_pos
                for a, b in self.spans:  # (causal or within the run), then the window: transformers' order
                    m |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
                if window is not None:
                    m &= k_pos > q_pos - window  # HF sliding-window semantics
                self._masks[window] = m
        return self._masks[window]


@dataclass
class StepMetadata:
    """Everything the attention needs for one step, built once and shared by all layers.

    Packed rows ``0 .. num_decode - 1`` are single-token (decode) items, followed by prefill
    segments (or, read by the native prefill kernel, the chunks of ``prefill_plan``).
    ``decode_blocks`` is the flattened ``[num_decode, max_blocks]`` block table
    (padded with the null block) and ``decode_ctx`` each decode item's context length. With the
    kernel operators, ``decode_table`` holds the same as ``[num_decode, width]`` int32 rows and
    ``segments`` how many parts the decode kernel splits each context into.
    """

    slot_mapping: torch.Tensor                  # [T] flat slot index per packed row
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None   # [num_decode * max_blocks]
    decode_max_blocks: int = 0
    decode_ctx: torch.Tensor | None = None      # [num_decode]
    prefills: list[PrefillSegment] = field(default_factory=list)
    fresh_blocks: torch.Tensor | None = None    # blocks getting their first slot written this step
    decode_table: torch.Tensor | None = None    # [num_decode, width] int32 (kernel operators)
    segments: int = 1
    # Prompt chunks continuing a cached prefix, for the kernel operators (not in ``prefills``):
    # block table [S, width], first rows, lengths, start positions (int32), the longest length.
    cached_prefill: tuple[Any, ...] | None = None
    # Every prompt chunk, for the native CPU prefill kernel (``native.ops.PrefillPlan``; not in ``prefills``).
    prefill_plan: Any = None
    # A hybrid model's recurrent layers: the step's state slots (``recurrent.StateStep``).
    states: Any = None
    # The rows whose outputs the step reads (sampled, or scored for prompt logprobs), each as a
    # decode row attending up to its own position: ``read_rows()`` -> (rows, their metadata), or
    # None when every row is read (``step_batch.read_rows``). Layers that write no keys (Gemma 4's
    # last ones) need run only these.
    read_rows: Callable[[], tuple[torch.Tensor, "StepMetadata"] | None] | None = None
    _decode_masks: dict[tuple[int | None, Any], torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[1, num_decode, 1, L]`` mask broadcast over kv heads and GQA groups.

        Bool (True = attend) when ``dtype`` is None, else additive (0 / -inf) in ``dtype``.
        """
        key = (window, dtype)
        if key not in self._decode_masks:
            if dtype is not None:
                allowed = self.decode_mask(window, block_size)
                bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                self._decode_masks[key] = bias.masked_fill_(~allowed, float("-inf"))
            else:
                ctx = self.decode_ctx
                k_pos = torch.arange(self.decode_max_blocks * block_size, device=ctx.device)[None, :]
                m = k_pos < ctx[:, None]
                if window is not None:
                    m &= k_pos >= (ctx[:, None] - window)
                self._decode_masks[key] = m.view(1, self.num_decode, 1, -1)
        return self._decode_masks[key]


# The step being run; set by the runner around its forward (all calls come from one thread).
_CURRENT: tuple[PagedKVCache, StepMetadata] | None = None


@contextmanager
def step_context(cache: PagedKVCache, meta: StepMetadata) -> Iterator[None]:
    global _CURRENT
    _CURRENT = (cache, meta)
    try:
        yield
    finally:
        _CURRENT = None


def _sink_softmax(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax (fp32) of ``scores [..., L]`` with one more logit per row that has no value
    (``sinks``, broadcast to ``[..., 1]``), that column dropped: gpt-oss's attention sinks."""
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), -1), -1, dtype=torch.float32)[..., :-1]


def _attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor | None,
                       scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [kvh, G, n, D]`` over ``keys``/``vals [kvh, L, D]`` where ``allowed`` (bool,
    broadcast to ``[n, L]``; None: causal with the queries at the last n positions), with one sink
    logit per query head (``sinks [kvh * G]``) -> ``[kvh, G, n, D]``. Plain matmuls: SDPA has no sinks."""
    kvh, G, n, D = q.shape
    L = keys.shape[1]
    scores = torch.matmul(q.reshape(kvh, G * n, D), keys.transpose(-1, -2)).view(kvh, G, n, L).mul_(scale)
    if allowed is None:
        allowed = torch.ones(n, L, dtype=torch.bool, device=q.device).tril_(L - n)
    scores.masked_fill_(~allowed, float("-inf"))
    probs = _sink_softmax(scores, sinks.view(kvh, G, 1, 1)).to(vals.dtype)
    return torch.matmul(probs.view(kvh, G * n, L), vals).view(kvh, G, n, D)


def paged_attention(cache: PagedKVCache, meta: StepMetadata, layer: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scaling: float | None = None, window: int | None = None,
                    kv_written: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one layer over the paged cache: ``q [T, H, D]``, ``k``/``v [T, kvh, D]`` -> ``[T, H, D]``.

    Writes the step's keys and values into their slots first (unless ``kv_written``: the kernel
    operators' RoPE already stored them, or another layer did, whose keys this one reads), then
    attends: decode rows (the first ``meta.num_decode``) over their gathered blocks, each prefill
    segment over its own chunk or, when it continues a cached prefix, over its gathered blocks.
    ``sinks``: one logit per query head ``[H]`` that joins each softmax's denominator (gpt-oss);
    the kernel operators have none, so a model with sinks runs without them (the runner's choice).
    """
    T, H, D = q.shape
    kvh = k.shape[1]
    group = H // kvh
    bs = cache.block_size
    blocks_view, slots_view = cache.layers[layer]
    nd = meta.num_decode
    if cache.kernel_ops:
        if sinks is not None:
            raise RuntimeError("attention sinks are not applied by the kernel operators")
        if not kv_written:
            torch.ops.llmserve.store_kv(slots_view, meta.slot_mapping, k, v)
        scale = D ** -0.5 if scaling is None else scaling
        if nd:
            dec_out = torch.ops.llmserve.paged_decode(q[:nd], blocks_view, meta.decode_table, meta.decode_ctx,
                                                      scale, window or 0, meta.segments)
            if not meta.prefills and meta.cached_prefill is None:
                return dec_out
            out = q.new_empty(T, H, D)
            out[:nd] = dec_out
        else:
            out = q.new_empty(T, H, D)
        if meta.cached_prefill is not None:
            torch.ops.llmserve.paged_prefill(q, blocks_view, *meta.cached_prefill[:4], out, scale, window or 0,
                                             meta.cached_prefill[4])
        return _prefill(cache, meta, blocks_view, q, k, v, out, scaling, window, group)
    if kv_written:
        pass
    elif cache.write_kv is not None:
        cache.write_kv(slots_view, meta.slot_mapping, k if k.stride(2) == 1 else k.contiguous(),
                       v if v.stride(2) == 1 else v.contiguous())
    else:
        slots_view.index_copy_(1, meta.slot_mapping, torch.cat((k, v), 1).transpose(0, 1).to(slots_view.dtype))

    if nd and cache.decode_kernel is not None:
        # The kernel reads the queries in place (a strided view of the fused QKV output) and
        # writes the decode rows of the layer's output directly.
        out = q.new_empty(T, H, D)
        cache.decode_kernel(q[:nd] if q.stride(2) == 1 else q[:nd].contiguous(), blocks_view, meta.decode_blocks,
                            meta.decode_ctx, out[:nd], D ** -0.5 if scaling is None else scaling, window, sinks=sinks)
        if not meta.prefills and meta.prefill_plan is None:
            return out
    elif nd:
        keys, vals = cache.gather(blocks_view, meta.decode_blocks, q.dtype)
        keys, vals = keys.view(kvh, nd, -1, D), vals.view(kvh, nd, -1, D)
        # GQA without repeating K/V: a kv head's query group acts as a short query sequence.
        qd = q[:nd].view(nd, kvh, group, D).transpose(0, 1)                # [kvh, nd, G, D]
        if (qd.device.type == "cpu" and cache.matmul_decode) or sinks is not None:
            # Plain matmuls beat the CPU flash kernel on these many tiny (G x L) problems (and SDPA has no sinks).
            scores = torch.matmul(qd, keys.transpose(-1, -2))
            scores.mul_(D ** -0.5 if scaling is None else scaling).add_(meta.decode_mask(window, bs, scores.dtype))
            probs = (torch.softmax(scores, -1, dtype=torch.float32) if sinks is None
                     else _sink_softmax(scores, sinks.view(kvh, 1, group, 1)))
            o = torch.matmul(probs.to(vals.dtype), vals)
        else:
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=meta.decode_mask(window, bs), scale=scaling)
        dec_out = o.transpose(0, 1).reshape(nd, H, D)
        if not meta.prefills and meta.prefill_plan is None:
            return dec_out
        out = q.new_empty(T, H, D)
        out[:nd] = dec_out
    else:
        out = q.new_empty(T, H, D)
    return _prefill(cache, meta, blocks_view, q, k, v, out, scaling, window, group, sinks)


def _prefill(cache: PagedKVCache, meta: StepMetadata, blocks_view: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, out: torch.Tensor, scaling: float | None, window: int | None,
             group: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The prompt chunks' rows of ``out``: those of ``meta.prefill_plan`` by the native kernel,
    which reads the cache in place (their keys and values are already written); each of
    ``meta.prefills`` over its own chunk or, when it continues a cached prefix, over its
    gathered blocks."""
    if meta.prefill_plan is not None:
        cache.prefill_kernel(q if q.stride(2) == 1 else q.contiguous(), blocks_view, meta.prefill_plan, out,
                             q.shape[-1] ** -0.5 if scaling is None else scaling, window, sinks=sinks)
    for seg in meta.prefills:
        rows = slice(seg.row, seg.row + seg.n)
        qs = q[rows].transpose(0, 1)[None]                                 # [1, H, n, D]
        if seg.blocks is None:
            keys, vals = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        else:
            ctx = seg.start + seg.n
            keys, vals = cache.gather(blocks_view, seg.blocks, q.dtype)
            keys, vals = keys[None, :, :ctx], vals[None, :, :ctx]
        mask = seg.mask(window, q.device)
        if sinks is not None:
            kvh = keys.shape[1]
            o = _attend_with_sinks(qs[0].reshape(kvh, group, seg.n, -1), keys[0], vals[0], mask,
                                   q.shape[-1] ** -0.5 if scaling is None else scaling, sinks)
            out[rows] = o.view(kvh * group, seg.n, -1).transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, is_causal=mask is None,
                                           scale=scaling, enable_gqa=group > 1)
        out[rows] = o[0].transpose(0, 1)
    return out


def current_step() -> tuple[PagedKVCache, StepMetadata]:
    """The cache and metadata of the step being run (raises outside a backend step)."""
    if _CURRENT is None:
        raise RuntimeError("llmserve paged attention called outside a backend step")
    return _CURRENT


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query [1, H, T, D]``, ``key``/``value [1, kvh, T, D]``
    (after RoPE) -> ``[1, T, H, D]``."""
    cache, meta = current_step()
    if kwargs.get("softcap") is not None:
        # The loader refuses such models; this guards models that pass it per call only.
        raise RuntimeError("attention softcapping is not supported by the torch backend")
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks
    layer = module.layer_idx if cache.layer_of is None else cache.layer_of[module.layer_idx]
    out = paged_attention(cache, meta, layer, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), scaling, kwargs.get("sliding_window"),
                          sinks=None if sinks is None else sinks.detach())
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make ``attn_implementation="llmserve_paged"`` known to transformers (idempotent).

    It is deliberately NOT registered in ``AttentionMaskInterface``: transformers then skips
    building any causal mask for it (masks come from the step metadata instead).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
