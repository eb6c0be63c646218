"""ctypes wrappers of the native CPU kernels: decode attention and the KV write
(``csrc/paged_decode.c``), packed linear layers (``csrc/packed_linear.c``) and the fused
forward's small per-layer operations (``csrc/elementwise.c``).

Each factory returns None when its library cannot be had here (``build.library``); the
backend then keeps its torch path.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import torch

from llmserve import progress

from .build import F32, I64, INT, PTR, bind, library
from .panels import pack_codes

DecodeKernel = Callable[..., None]


def _row_head_strides(t: torch.Tensor, name: str) -> tuple[int, int]:
    """Row and head strides of a ``[rows, heads, D]`` fp32 CPU view whose head vectors are contiguous."""
    if t.dim() != 3 or t.stride(2) != 1 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a [rows, heads, D] fp32 CPU view with contiguous head vectors")
    return t.stride(0), t.stride(1)


def _attention_shapes(q: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, what: str) -> tuple[int, ...]:
    """The strides and sizes an attention kernel takes, checked: ``q``/``out [rows, H, D]`` (q with
    any row and head strides, out with contiguous heads), ``pool [2*kvh, nblocks, bs, width]``.
    Returns ``(q_row, q_head, out_row, H, kvh, D, nblocks, bs)``."""
    rows, H, D = q.shape
    q_row, q_head = _row_head_strides(q, "q")
    out_row, out_head = _row_head_strides(out, "out")
    if out_head != D or out.shape != q.shape:
        raise ValueError(f"{what}: out must be [rows, H, D] with contiguous heads")
    two_kvh, nblocks, bs, _ = pool.shape
    if not _pool_fits(pool, D) or H % max(two_kvh // 2, 1):
        raise ValueError(f"{what}: the pool's dtype, head size or KV heads do not fit the queries")
    return q_row, q_head, out_row, H, two_kvh // 2, D, nblocks, bs


def _sinks_ptr(sinks: torch.Tensor | None, H: int, what: str) -> int | None:
    """The address of ``sinks`` (one fp32 attention-sink logit per query head, contiguous, on the
    CPU), checked; None (a NULL pointer: no sinks) when there are none."""
    if sinks is None:
        return None
    if (sinks.dtype != torch.float32 or sinks.shape != (H,) or not sinks.is_contiguous()
            or sinks.device.type != "cpu"):
        raise ValueError(f"{what}: sinks must be a contiguous fp32 CPU tensor of shape [{H}] (one per query head)")
    return sinks.data_ptr()


def _pool_fits(pool: torch.Tensor, D: int) -> bool:
    """A contiguous CPU pool of fp32 (or bf16) rows of D, or of int8 rows of D codes and their
    scales (``attention.row_width``)."""
    width = D + 4 * -(-D // 32) if pool.dtype == torch.int8 else D
    return (pool.shape[-1] == width and pool.is_contiguous() and pool.device.type == "cpu"
            and pool.dtype in PREFILL_POOL_DTYPES)


def decode_kernel(int8: bool = False) -> DecodeKernel | None:
    """The paged decode-attention function (over an fp32 pool, or with ``int8`` over int8 rows:
    ``csrc/paged_decode_q8.c``), or None when it cannot be had here."""
    name = "paged_decode_q8" if int8 else "paged_decode"
    lib = library(name, "decode-attention")
    if lib is None:
        return None
    cfn = bind(lib, "paged_decode_q8" if int8 else "paged_decode_f32", INT, PTR, I64, I64, *[PTR] * 4, I64,
               *[I64] * 7, F32, I64, PTR, INT)
    pool_dtype = torch.int8 if int8 else torch.float32

    def paged_decode(q: torch.Tensor, blocks_view: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                     out: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor | None = None) -> None:
        """``q``/``out [nd, H, D]`` (any row and head strides for q, e.g. a view of a fused QKV
        output; ``out`` with contiguous rows), ``blocks_view [2*kvh, nblocks, bs, D]``,
        ``tables [nd * max_blocks]`` and ``ctx [nd]`` (int64), all on the CPU. ``sinks [H]``
        (fp32, contiguous; None: none): per query head an attention-sink logit (gpt-oss), one more
        term of the softmax's denominator that has no value row."""
        q_row, q_head, out_row, H, kvh, D, nblocks, bs = _attention_shapes(q, out, blocks_view, "paged_decode")
        if blocks_view.dtype != pool_dtype:
            raise ValueError(f"paged_decode: this kernel reads a {pool_dtype} pool")
        sinks_ptr = _sinks_ptr(sinks, H, "paged_decode")
        nd = q.shape[0]
        rc = cfn(q.data_ptr(), q_row, q_head, blocks_view.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                 out.data_ptr(), out_row, nd, H, kvh, D, nblocks, bs, tables.numel() // max(nd, 1),
                 scale, window or 0, sinks_ptr, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")

    return paged_decode


PREFILL_POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def prefill_kernel() -> Callable[..., None] | None:
    """The paged prefill-attention function (``csrc/paged_prefill.c``), or None when it cannot be
    had here."""
    lib = library("paged_prefill", "prefill-attention")
    if lib is None:
        return None
    cfn = bind(lib, "paged_prefill", INT, PTR, I64, I64, PTR, INT, PTR, I64, PTR, PTR, PTR, I64, PTR, PTR,
               *[I64] * 6, F32, I64, PTR, INT)

    def paged_prefill(q: torch.Tensor, blocks_view: torch.Tensor, plan: "PrefillPlan", out: torch.Tensor,
                      scale: float, window: int | None, sinks: torch.Tensor | None = None) -> None:
        """Prompt-chunk rows of ``out [T, H, D]`` (contiguous heads and rows) from ``q [T, H, D]``
        (any row and head strides, e.g. a view of a fused QKV output; fp32) attending through
        ``plan``'s block tables to ``blocks_view [2*kvh, nblocks, bs, D]`` (fp32 or bf16; int8
        rows are wider: codes and scales). ``sinks [H]`` (fp32, contiguous; None: none): per
        query head an attention-sink logit (gpt-oss), one more term of the softmax's denominator
        that has no value row."""
        q_row, q_head, out_row, H, kvh, D, nblocks, bs = _attention_shapes(q, out, blocks_view, "paged_prefill")
        if plan.rows_end > q.shape[0] or plan.max_block >= nblocks or plan.block_size != bs:
            raise ValueError("paged_prefill: the plan does not fit this step")
        sinks_ptr = _sinks_ptr(sinks, H, "paged_prefill")
        rc = cfn(q.data_ptr(), q_row, q_head, blocks_view.data_ptr(), PREFILL_POOL_DTYPES[blocks_view.dtype],
                 plan.tables.data_ptr(), plan.width, plan.rows.data_ptr(), plan.lens.data_ptr(),
                 plan.starts.data_ptr(), plan.count, 0 if plan.key_end is None else plan.key_end.data_ptr(),
                 out.data_ptr(), out_row, H, kvh, D, nblocks, bs,
                 scale, window or 0, sinks_ptr, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the prefill-attention kernel could not allocate its scratch memory")

    return paged_prefill


class PrefillPlan:
    """The prompt chunks of one step as the prefill kernel reads them: per chunk its first packed
    row, its length, its first position and its block table (padded to one width), as int64
    tensors built once per step and read by every layer."""

    __slots__ = ("tables", "width", "rows", "lens", "starts", "count", "rows_end", "max_block", "block_size",
                 "key_end")

    def __init__(self, chunks: list[tuple[int, int, int, list[int]]], block_size: int, pad_block: int,
                 key_end: torch.Tensor | None = None) -> None:
        """``chunks``: (first row, length, first position, block table covering every position up
        to the chunk's last) per chunk; ``pad_block``: a valid block id to pad the tables with;
        ``key_end`` (int64, one per packed row; None: causal): the last key position each row sees,
        past its own for an image's tokens that attend to each other both ways (Gemma 3), each
        within its chunk."""
        for row, n, start, table in chunks:
            if n < 1 or start < 0 or row < 0 or len(table) < -(-(start + n) // block_size):
                raise ValueError("a prefill chunk needs a length, a non-negative row and start and a block "
                                 "table covering its positions")
        self.count, self.block_size = len(chunks), block_size
        if any(b < 0 for c in chunks for b in c[3]):
            raise ValueError("a prefill chunk's block table holds a negative block id")
        self.width = max((len(c[3]) for c in chunks), default=1)
        flat = [b for c in chunks for b in (*c[3], *[pad_block] * (self.width - len(c[3])))]
        self.tables = torch.tensor(flat or [pad_block], dtype=torch.int64)
        self.rows, self.lens, self.starts = (torch.tensor([c[i] for c in chunks], dtype=torch.int64)
                                             for i in range(3))
        self.rows_end = max((c[0] + c[1] for c in chunks), default=0)
        self.max_block = max(flat, default=pad_block)
        if key_end is not None:  # the kernel reads keys up to these through the tables: each within its chunk
            key_end = key_end.to(torch.int64).contiguous()
            for row, n, start, _ in chunks:
                rows = key_end[row:row + n]
                if rows.numel() != n or bool(((rows < torch.arange(start, start + n)) | (rows >= start + n)).any()):
                    raise ValueError("a prefill chunk's key limits must lie between each row's position and the "
                                     "chunk's last")
        self.key_end = key_end


def kv_writer(int8: bool = False) -> Callable[..., None] | None:
    """The native KV write (the step's keys and values into their pool slots; with ``int8``
    quantized into int8 rows), or None."""
    name = "paged_decode_q8" if int8 else "paged_decode"
    lib = library(name, "decode-attention")
    if lib is None:
        return None
    cfn = bind(lib, "write_kv_q8" if int8 else "write_kv_f32", INT, PTR, I64, I64, PTR, I64, I64, PTR,
               *[I64] * 4, PTR)
    pool_dtype = torch.int8 if int8 else torch.float32

    def write_kv(slots_view: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``slots_view [2*kvh, nslots, D]`` (contiguous) gets ``k``/``v [T, kvh, D]`` at
        ``slot_mapping [T]`` (int64); k and v may be strided views with contiguous heads."""
        two_kvh, nslots, _ = slots_view.shape
        T, kvh, D = k.shape
        k_row, k_head = _row_head_strides(k, "k")
        v_row, v_head = _row_head_strides(v, "v")
        if (v.shape != k.shape or two_kvh != 2 * kvh or slots_view.dtype != pool_dtype
                or not _pool_fits(slots_view, D) or slot_mapping.numel() != T):
            raise ValueError("write_kv: mismatched shapes")
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            raise ValueError("write_kv: slot_mapping must be contiguous int64")
        if cfn(k.data_ptr(), k_row, k_head, v.data_ptr(), v_row, v_head, slot_mapping.data_ptr(), T, kvh, D, nslots,
               slots_view.data_ptr()) != 0:
            raise IndexError("write_kv: a slot is outside the KV pool")

    return write_kv


class PackedLinear:
    """``y = x @ weight.T + bias`` for fp32 CPU inputs, with ``weight [N, K]`` copied once into
    the kernel's panel layout. Callable like ``F.linear`` on a 2-D ``[M, K]`` input, for any M.

    ``format`` is ``"q4"`` or ``"q8"`` when the weights are stored as 4-bit or 8-bit codes
    with a scale (and, for 4 bits, an offset) per 32 inputs of a column, which happens only
    where those reproduce every fp32 weight bit for bit (a model dequantized from GGUF Q4_1
    or Q8_0 blocks, for one): 0.75 or 1.125 bytes per weight instead of 4, and the same output
    bits. Otherwise, and with ``compact=False``, ``"f32"``. ``kernel`` is the
    address of the C function that reads this format (the native decoder step calls it).
    """

    __slots__ = ("_fn", "kernel", "format", "packed", "bias", "out_features", "in_features")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None,
                 compact: bool = True) -> None:
        weight = weight.detach().contiguous()
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // 16)
        f32 = torch.empty(panels * self.in_features * 16, dtype=torch.float32)
        pack = bind(lib, "pack_weight_f32", None, PTR, PTR, I64, I64)
        pack(weight.data_ptr(), f32.data_ptr(), self.out_features, self.in_features)
        self.format, self.packed = "f32", f32
        if compact:
            for bits in (4, 8):
                codes = pack_codes(lib, weight, f32, bits)
                if codes is not None:
                    self.format, self.packed = f"q{bits}", codes
                    break
        self.bias = bias.detach().contiguous() if bias is not None else None
        self._fn = bind(lib, f"packed_linear_{self.format}", None, *[PTR] * 4, I64, I64, I64, INT)
        self.kernel: int = ctypes.cast(self._fn, PTR).value
        progress.advance(self.out_features * self.in_features)  # the start-up's "packing weights"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [M, {self.in_features}] input, got {list(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                     y.data_ptr(), x.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return y


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, compact: bool = True) -> Any:
    """``weight`` (and ``bias``) packed for the native linear kernel, or None when the kernel is
    unavailable here or does not apply (only fp32 weights on the CPU do). ``compact``: try the
    lossless 4- and 8-bit panels (``panels.py``), then bf16 rows (``bf16_linear``), before keeping
    fp32 ones. Returns a ``PackedLinear`` or, for bf16 rows, a ``gguf_ops.GGUFLinear`` (the same
    call and the same ``kernel``/``packed`` pair for the native step)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or (bias is not None and (
            bias.dtype != torch.float32 or bias.device.type != "cpu")):
        return None
    if weight.dtype == torch.bfloat16 and compact:  # a bf16 checkpoint's weights (bf16_rows.py), as they are
        return bf16_linear(weight, bias)
    if weight.dtype != torch.float32:
        return None
    lib = library("packed_linear", "linear-layer")
    if lib is None:
        return None
    packed = PackedLinear(lib, weight, bias, compact)
    return (bf16_linear(weight, bias) or packed) if compact and packed.format == "f32" else packed


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``weight`` kept as bf16 rows and read by the GGUF kernels (their BF16 type: each weight
    widened exactly to fp32, then the same fp32 products), where it is bf16 or every weight is a
    bf16 number, as when a bf16 checkpoint is served in float32: half the bytes of fp32 panels,
    so half the memory and the bandwidth a decode step needs, and the same products. None where
    some weight is not, or the GGUF kernels are not built here."""
    # A copy of its own even where the weight is bf16 already: a checkpoint's tensor may be a view
    # of the memory-mapped file, whose whole mapping (every page read while loading) it would keep.
    w16 = weight.detach().to(torch.bfloat16, copy=True)
    if weight.dtype != torch.bfloat16 and not torch.equal(w16.to(torch.float32), weight):
        return None
    from .gguf_ops import BF16, QuantTensor, gguf_linear

    rows = QuantTensor(qtype=BF16, data=w16.contiguous().view(torch.uint8), shape=(weight.shape[0], weight.shape[1]))
    lin = gguf_linear([rows], bias)
    if lin is not None:
        progress.advance(weight.numel())  # the start-up's "packing weights", as PackedLinear does
    return lin


class ElementwiseOps:
    """The fused forward's per-layer small operations on contiguous fp32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = bind(lib, "add_rms_norm_f32", None, *[PTR] * 4, I64, I64, F32, INT)
        self._silu = bind(lib, "silu_mul_f32", None, PTR, PTR, I64, I64, INT)
        self._gelu = bind(lib, "gelu_tanh_mul_f32", None, PTR, PTR, I64, I64, INT)
        self._rope = bind(lib, "rope_f32", None, PTR, PTR, PTR, I64, I64, I64, I64, INT)
        self._qk_norm = bind(lib, "head_rms_norm_f32", None, PTR, PTR, PTR, *[I64] * 5, F32, INT)
        self._greedy = bind(lib, "greedy_pick_f32", I64, PTR, I64, I64, PTR, PTR, INT)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm of ``h`` scaled by ``weight``."""
        T, D = h.shape
        if not h.is_contiguous() or (delta is not None and (delta.shape != h.shape or not delta.is_contiguous())):
            raise ValueError("add_rms_norm needs contiguous [T, D] tensors of one shape")
        out = torch.empty_like(h)
        self._norm(h.data_ptr(), delta.data_ptr() if delta is not None else None, weight.data_ptr(),
                   out.data_ptr(), T, D, eps, torch.get_num_threads())
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a contiguous ``[T, 2 * I]`` gate-and-up tensor -> ``[T, I]``."""
        return self._gated(self._silu, gu)

    def gelu_tanh_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` (GELU's tanh approximation), as ``silu_mul``."""
        return self._gated(self._gelu, gu)

    @staticmethod
    def _gated(fn: Callable[..., None], gu: torch.Tensor) -> torch.Tensor:
        T, two_i = gu.shape
        if not gu.is_contiguous() or two_i % 2:
            raise ValueError("a gated activation needs a contiguous [T, 2 * I] tensor")
        out = gu.new_empty(T, two_i // 2)
        fn(gu.data_ptr(), out.data_ptr(), T, two_i // 2, torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding ("rotate half") in place on the first ``heads`` heads of each row of
        the 2-D ``x`` (rows may be wider: e.g. queries and keys followed by values), with
        contiguous per-row ``cos``/``sin`` ``[T, head_dim]``."""
        T, width = x.shape
        if (x.stride(1) != 1 or heads * head_dim > width or head_dim % 2 or cos.shape != (T, head_dim)
                or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous())):
            raise ValueError("rope needs rows of at least heads * head_dim floats and [T, head_dim] cos/sin")
        self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, heads, head_dim, x.stride(0),
                   torch.get_num_threads())

    def qk_norm(self, x: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> None:
        """RMSNorm in place of each of the first ``heads`` head vectors of each row of the 2-D ``x``
        (scaled by ``q_weight``) and of the ``kv_heads`` after them (by ``k_weight``)."""
        T, width = x.shape
        if (x.stride(1) != 1 or (heads + kv_heads) * head_dim > width or q_weight.shape != (head_dim,)
                or k_weight.shape != (head_dim,) or not (q_weight.is_contiguous() and k_weight.is_contiguous())):
            raise ValueError("qk_norm needs rows of at least (heads + kv_heads) * head_dim floats and [head_dim] "
                             "weights")
        self._qk_norm(x.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), T, heads, kv_heads, head_dim,
                      x.stride(0), eps, torch.get_num_threads())

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
        """Per row of contiguous fp32 ``[B, V]`` logits: the first index of the maximum (as
        ``argmax``) and its log-probability. None when a row holds NaN or no finite value
        (the caller's general path decides those)."""
        B, V = logits.shape
        if not logits.is_contiguous() or logits.dtype != torch.float32:
            return None
        tokens = torch.empty(B, dtype=torch.long)
        lps = torch.empty(B, dtype=torch.float32)
        if self._greedy(logits.data_ptr(), B, V, tokens.data_ptr(), lps.data_ptr(), torch.get_num_threads()):
            return None
        return tokens, lps.tolist()


def elementwise_ops() -> ElementwiseOps | None:
    """The native per-layer operations, or None when they cannot be had here."""
    lib = library("elementwise", "elementwise")
    return ElementwiseOps(lib) if lib is not None else None


class DeltaNetDecode:
    """A Gated DeltaNet layer's decode rows from its projections to its gated, normed output,
    updating the sequences' convolution windows and states in place (``csrc/deltanet_step.c``)."""

    MAX_DV = 1024

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._run = bind(lib, "deltanet_decode_f32", None, PTR, I64, PTR, I64, PTR, I64, PTR, I64, PTR, PTR, I64,
                         PTR, PTR, PTR, PTR, PTR, F32, PTR, PTR, *[I64] * 5, INT, INT)

    def __call__(self, p: Any, conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
        """``p``: the layer's ``recurrent.DeltaNetParams``; ``conv [rows, C, K - 1]`` and ``ssm
        [rows, Hv, Dk, Dv]``: its pools (updated at rows ``slots [B]``); ``x [B, C]``, ``z [B, Hv * Dv]``,
        ``b``, ``a [B, Hv]``: its projections (rows may be strided, elements contiguous); ``out
        [B, Hv * Dv]`` (contiguous) receives the output."""
        B = slots.shape[0]
        Hk, Hv, Dk, Dv = p.key_heads, p.value_heads, p.key_dim, p.value_dim
        C, K = 2 * Hk * Dk + Hv * Dv, p.conv.shape[1]
        fp32 = (conv, ssm, x, z, b, a, out, p.conv, p.neg_a, p.dt_bias, p.norm)
        if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in fp32) or slots.dtype != torch.int64
                or any(t.shape[0] != B or t.stride(-1) != 1 for t in (x, z, b, a, out)) or not out.is_contiguous()
                or not all(t.is_contiguous() for t in (conv, ssm, p.conv, p.neg_a, p.dt_bias, p.norm))
                or tuple(conv.shape[1:]) != (C, K - 1) or tuple(ssm.shape[1:]) != (Hv, Dk, Dv)
                or Dv > self.MAX_DV or Hv % Hk):
            raise ValueError("deltanet_decode needs float32 CPU tensors of the layer's shapes and int64 slots")
        scratch = torch.empty(B, C, dtype=torch.float32)
        slots = slots.contiguous()
        self._run(x.data_ptr(), x.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), b.stride(0), a.data_ptr(),
                  a.stride(0), conv.data_ptr(), p.conv.data_ptr(), K, ssm.data_ptr(), slots.data_ptr(),
                  p.neg_a.data_ptr(), p.dt_bias.data_ptr(), p.norm.data_ptr(), p.eps, scratch.data_ptr(),
                  out.data_ptr(), B, Hk, Hv, Dk, Dv, int(p.tiled), torch.get_num_threads())


def deltanet_decode() -> DeltaNetDecode | None:
    """The native decode rows of a Gated DeltaNet layer, or None when they cannot be had here."""
    lib = library("deltanet_step", "Gated DeltaNet decode")
    return DeltaNetDecode(lib) if lib is not None else None
