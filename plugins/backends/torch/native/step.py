"""A decode-only step of the fused forward as one native call (``csrc/decoder_step.c``).

When every projection of the fused forward is packed for the native linear kernel, its small
operations are the native ones and the KV cache has the native decode attention and KV write,
a step whose rows are all decode tokens runs every layer inside C: the same kernels, in the
same order, with the same arguments as the Python layer loop (so the same bits), without ~12
ctypes round trips per layer and the GIL each of them must take back. Steps with prefill rows
keep the Python loop (their attention uses torch).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .build import library
from .ops import ElementwiseOps, PackedLinear

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("norm", "silu", "rope", "write_kv", "decode", "head_norm", "gelu")]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qkv", "qkv_bias", "o", "o_bias", "gu", "gu_bias", "down", "down_bias",
                                        "ln1", "ln2", "q_norm", "k_norm", "post_attn", "post_mlp", "pool",
                                        "qkv_fn", "o_fn", "gu_fn", "down_fn")] + [
        ("eps1", _F32), ("eps2", _F32), ("qk_eps", _F32), ("post_eps", _F32), ("scale", _F32), ("window", _I64),
        ("act", _I64), ("rope", _I64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("norm_w", _P), ("norm_eps", _F32)]


class _Work(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("x", "qkv", "attn", "o", "gu", "act", "delta")]


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _P).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeDecodeStep:
    """Runs decode-only steps of one ``FusedDecoder`` over one ``PagedKVCache``."""

    def __init__(self, fused: Any, cache: Any, lib: ctypes.CDLL, kernels: _Kernels) -> None:
        self.cache = cache
        self._rope_kinds = list(fused.rope_kinds)
        self._kernels = kernels
        self._fn = lib.decoder_step_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        lays = fused.layers
        gu_out = lays[0].gu.out_features
        self.hidden = lays[0].qkv.in_features
        self.heads, self.kv_heads, self.head_dim = fused.heads, fused.kv_heads, fused.head_dim
        self.inter = gu_out // 2
        self._model = _Model(len(lays), self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
                             fused.norm_w.data_ptr(), fused.norm_eps)
        self._layers = (_Layer * len(lays))()
        for slot, lay in zip(self._layers, lays):
            for name in ("qkv", "o", "gu", "down"):  # each projection with the kernel for its format
                lin = getattr(lay, name)
                setattr(slot, name, lin.packed.data_ptr())
                setattr(slot, f"{name}_bias", _ptr(lin.bias))
                setattr(slot, f"{name}_fn", lin.kernel)
            slot.ln1, slot.ln2 = lay.ln1.data_ptr(), lay.ln2.data_ptr()
            slot.q_norm, slot.k_norm, slot.qk_eps = _ptr(lay.q_norm), _ptr(lay.k_norm), lay.qk_eps
            slot.post_attn, slot.post_mlp, slot.post_eps = _ptr(lay.post_attn), _ptr(lay.post_mlp), lay.post_eps
            slot.act, slot.rope = int(lay.gelu), fused.rope_kinds.index(lay.rope)
            slot.pool = cache.layers[lay.idx][0].data_ptr()
            slot.eps1, slot.eps2, slot.scale, slot.window = lay.eps1, lay.eps2, lay.scaling, lay.window or 0
        # The tensors behind those pointers live as long as the fused decoder (which holds this
        # object) and the cache (held here).
        blocks_view = cache.layers[0][0]  # [2 * kvh, nblocks, bs, D], the same for every layer
        self._nblocks, self._block_size = blocks_view.shape[1], blocks_view.shape[2]
        self._sizes = [self.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, self.heads * self.head_dim,
                       self.hidden, 2 * self.inter, self.inter, self.hidden]
        self._work = torch.empty(0, dtype=torch.float32)
        self._work_rows = -1          # the row count self._work_ptrs was laid out for
        self._work_ptrs = _Work()

    @classmethod
    def build(cls, fused: Any, cache: Any) -> "NativeDecodeStep | None":
        """The native step for ``fused`` over ``cache``, or None when some part is not native
        (torch ops, an unpacked projection, no native attention, a non-square head layout)."""
        if not isinstance(fused.ops, ElementwiseOps) or cache.decode_kernel is None or cache.write_kv is None:
            return None
        lays = fused.layers
        # A packed projection or a GGUF one (``gguf_ops.GGUFLinear``): both carry a C kernel of
        # the step's linear type and the weight pointer it takes.
        if not lays or not all(isinstance(getattr(lay, p), PackedLinear) or getattr(getattr(lay, p), "kernel", 0)
                               for lay in lays for p in ("qkv", "o", "gu", "down")):
            return None
        H, kvh, D = fused.heads, fused.kv_heads, fused.head_dim
        hidden, inter2 = lays[0].qkv.in_features, lays[0].gu.out_features
        for lay in lays:  # every layer the same shapes (the C loop assumes it)
            if ((lay.qkv.in_features, lay.qkv.out_features) != (hidden, (H + 2 * kvh) * D)
                    or (lay.o.in_features, lay.o.out_features) != (H * D, hidden)
                    or (lay.gu.in_features, lay.gu.out_features) != (hidden, inter2)
                    or (lay.down.in_features, lay.down.out_features) != (inter2 // 2, hidden) or inter2 % 2):
                return None
        norms = [t for lay in lays for t in (lay.ln1, lay.ln2, lay.q_norm, lay.k_norm, lay.post_attn, lay.post_mlp)
                 if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (fused.norm_w, *norms)):
            return None
        step_lib = library("decoder_step", "decoder-step")
        ew_lib = library("elementwise", "elementwise")
        int8 = cache.pool.dtype == torch.int8  # the int8 cache's own write and attention
        attn_lib = library("paged_decode_q8" if int8 else "paged_decode", "decode-attention")
        if None in (step_lib, ew_lib, attn_lib):
            return None
        suffix = "q8" if int8 else "f32"
        kernels = _Kernels(_fn(ew_lib, "add_rms_norm_f32"),
                           _fn(ew_lib, "silu_mul_f32"), _fn(ew_lib, "rope_f32"), _fn(attn_lib, f"write_kv_{suffix}"),
                           _fn(attn_lib, f"paged_decode_{suffix}"), _fn(ew_lib, "head_rms_norm_f32"),
                           _fn(ew_lib, "gelu_tanh_mul_f32"))
        return cls(fused, cache, step_lib, kernels)

    def __call__(self, h: torch.Tensor, ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
                 meta: Any) -> torch.Tensor:
        """``h [T, hidden]`` (the embedded tokens; used as the residual stream) -> the final
        normed hidden states ``[T, hidden]``; writes the step's KV. ``ropes``: cos/sin ``[T, D]``
        per RoPE kind of the fused decoder. Every row must be a decode row of ``meta``."""
        T = h.shape[0]
        if len(ropes) == 1:
            cos, sin = next(iter(ropes.values()))
        else:  # one [kinds, T, D] table each, in the order the layers' indices count
            cos, sin = (torch.stack([ropes[k][i] for k in self._rope_kinds]) for i in (0, 1))
            cos, sin = cos.view(-1, self.head_dim), sin.view(-1, self.head_dim)
        if (h.shape != (T, self.hidden) or not h.is_contiguous() or h.dtype != torch.float32
                or cos.shape != (T * len(ropes), self.head_dim) or sin.shape != cos.shape
                or not (cos.is_contiguous() and sin.is_contiguous()) or meta.num_decode != T or meta.prefills):
            raise ValueError("native decode step: expected decode rows only, with contiguous fp32 inputs")
        tables, ctx, slots = meta.decode_blocks, meta.decode_ctx, meta.slot_mapping
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in (tables, ctx, slots)) or slots.numel() != T:
            raise ValueError("native decode step: block tables, context lengths and slots must be int64")
        if T != self._work_rows:  # scratch buffers laid out again only when the batch size changes
            need = T * sum(self._sizes)
            if self._work.numel() < need:
                self._work = torch.empty(need, dtype=torch.float32)
            base, offset = self._work.data_ptr(), 0
            for name, size in zip((f[0] for f in _Work._fields_), self._sizes):
                setattr(self._work_ptrs, name, base + self._work.element_size() * offset)
                offset += T * size
            self._work_rows = T
        out = torch.empty_like(h)
        rc = self._fn(ctypes.addressof(self._kernels), ctypes.addressof(self._model), ctypes.addressof(self._layers),
                      ctypes.addressof(self._work_ptrs), h.data_ptr(), out.data_ptr(), T, cos.data_ptr(),
                      sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), ctx.data_ptr(), meta.decode_max_blocks,
                      self._nblocks, self._block_size, torch.get_num_threads())
        if rc == -1:
            raise IndexError("native decode step: a slot is outside the KV pool")
        if rc != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")
        return out
