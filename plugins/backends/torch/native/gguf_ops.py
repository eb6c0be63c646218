"""Linear layers and embedding rows read straight from GGUF-quantized weights (``csrc/gguf_linear.c``).

A GGUF tensor's bytes are used as the file stores them (no fp32 copy, no repacking): each
weight is rebuilt in fp32 exactly as ``gguf.quants.dequantize`` (and ggml) rebuilds it, and
multiplied into fp32 activations with fp32 FMAs, so a result equals an fp32 matmul on the
dequantized matrix up to summation order. On this exact path activations are never quantized.

``gguf_linear`` takes one or more parts concatenated along the outputs (a fused QKV whose q/k
are Q4_K and v is Q6_K, a fused gate-and-up), each with its own type and an optional row
permutation, and returns a ``GGUFLinear`` with ``PackedLinear``'s duck type (``ops.py``), so the
fused forward and the one-call decode step (``step.py``) drive it like any packed projection.

``gguf_linear(..., bf16=True)`` trades that exactness for speed on CPUs with AMX: from five rows
of x on (prefill, batched decode), weights and activations are rounded to bf16 and multiplied
on the tile unit with fp32 accumulation (``y`` then equals ``bf16(x) @ bf16(W).T`` up to
summation order). Fewer rows, and CPUs without AMX, keep the exact fp32 kernel.

``gguf_linear(..., int8=True)`` trades exactness for speed on decode steps and short prompts
instead (up to ``int8_rows()`` rows of x: 64 where the CPU has AVX-512 VNNI, 16 otherwise;
``csrc/gguf_q8.h``): each row of x is quantized once per call to int8 in blocks of 32
(``d = max|x| / 127``, ``q = x / d`` rounded to nearest, ties to even), and every Q8_0, Q4_0,
Q5_0, Q4_K, Q5_K or Q6_K block is multiplied into it with integer dot products and the block's
own fp32 scales, so ``y`` equals ``sum_b d_x[b] * (q_x[b] . dequantize(W)[b])`` up to fp32
rounding (on random data the outputs stay within about 1% of ``max|y|`` of the exact ones).
Parts of other types, and more rows, keep the exact kernel bit for bit. With both options, bf16
wins where AMX is there.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .build import I64, PTR, bind, library

_T = GGMLQuantizationType
SUPPORTED: dict[int, str] = {int(t): t.name for t in (
    _T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K,
    _T.Q6_K, _T.IQ4_NL, _T.IQ4_XS, _T.MXFP4)}
# The types ``int8=True`` multiplies with int8 activations (``csrc/gguf_q8.h``); others stay exact.
INT8_TYPES = frozenset(int(t) for t in (_T.Q8_0, _T.Q4_0, _T.Q5_0, _T.Q4_K, _T.Q5_K, _T.Q6_K))
Q8_0 = int(_T.Q8_0)
BF16 = int(_T.BF16)


def _type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def unsupported_error(qtype: int, tensor_name: str) -> str:
    """One line naming ``tensor_name``'s type and the types the CPU kernels serve."""
    return (f"{tensor_name}: GGUF type {_type_name(qtype)} is not served by the CPU kernels "
            f"(served: {', '.join(SUPPORTED.values())}; the IQ1-IQ3 and TQ types are not)")


@dataclass
class QuantTensor:
    """One GGUF weight as stored: ``data`` uint8 ``[rows, row_bytes]`` (the file's bytes, possibly
    read-only memory: never written), ``shape`` ``(N outputs, K inputs)``; output n is stored in
    row ``rows[n]`` (int32 ``[N]``) when ``rows`` is given, else in row n."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]
    rows: torch.Tensor | None = None

    def check(self, name: str = "tensor") -> None:
        """Raise ``ValueError`` (one line) unless the kernels can read this tensor."""
        if self.qtype not in SUPPORTED:
            raise ValueError(unsupported_error(self.qtype, name))
        N, K = self.shape
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        if K <= 0 or K % block:
            raise ValueError(f"{name}: {K} inputs is not a multiple of the {_type_name(self.qtype)} "
                             f"block size {block}")
        d = self.data
        if d.dtype != torch.uint8 or d.dim() != 2 or d.device.type != "cpu" or (d.shape[0] > 1 and d.stride(1) != 1):
            raise ValueError(f"{name}: data must be a uint8 [rows, row_bytes] CPU tensor with contiguous rows")
        if d.shape[1] != K // block * size:
            raise ValueError(f"{name}: rows of {d.shape[1]} bytes do not hold {K} {_type_name(self.qtype)} "
                             f"weights ({K // block * size} bytes)")
        if self.rows is None:
            if d.shape[0] < N:
                raise ValueError(f"{name}: {d.shape[0]} stored rows for {N} outputs")
        elif (self.rows.dtype != torch.int32 or self.rows.shape != (N,) or not self.rows.is_contiguous()
              or (N and (int(self.rows.min()) < 0 or int(self.rows.max()) >= d.shape[0]))):
            raise ValueError(f"{name}: rows must be a contiguous int32 [{N}] index of stored rows")

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Stored row index (int64) of each output index in ``ids``."""
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"row index outside 0..{self.shape[0] - 1}")
        return self.rows.to(torch.int64)[ids] if self.rows is not None else ids


def _dequantize_numpy(t: QuantTensor, phys: torch.Tensor) -> torch.Tensor:
    """Rows ``phys`` of ``t`` dequantized by gguf's numpy reference."""
    raw = t.data.numpy()[phys.numpy()]
    out = gguf_quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t.qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(len(phys), t.shape[1]))


def dequantize(t: QuantTensor) -> torch.Tensor:
    """The fp32 ``[N, K]`` matrix ``t`` stands for (gguf's numpy dequantizer; honours ``t.rows``)."""
    t.check()
    return _dequantize_numpy(t, t.physical(torch.arange(t.shape[0])))


class GGUFLinear:
    """``y = x @ W.T + bias`` for fp32 ``[M, K]`` CPU inputs with ``W`` the parts' quantized rows
    concatenated along N, read in their stored layout. ``kernel`` is the address of the C
    function (``decoder_step.c``'s ``linear_fn`` type) and ``packed`` the small descriptor of the
    parts it takes as its weight pointer; ``format`` names the parts' types (``"q4_k+q6_k"``) and
    ``activations`` the kernel's treatment of x: ``"fp32"`` (exact), ``"bf16"`` (AMX tiles from five
    rows) or ``"int8"`` (quantized, up to eight rows)."""

    __slots__ = ("_fn", "_parts", "kernel", "format", "activations", "packed", "bias", "out_features",
                 "in_features")

    def __init__(self, lib: ctypes.CDLL | None, parts: list[QuantTensor], bias: torch.Tensor | None,
                 bf16: bool = False, int8: bool = False) -> None:
        self._parts = list(parts)  # keeps every part's bytes (and rows index) alive for the descriptor
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        names: list[str] = []
        for p in parts:
            if (name := SUPPORTED[p.qtype].lower()) not in names:
                names.append(name)
        self.format = "+".join(names)
        # Descriptor: [nseg, then per part: type, base address, row stride, outputs, rows address or 0].
        desc = [len(parts)]
        for p in parts:
            desc += [p.qtype, p.data.data_ptr(), p.data.stride(0) if p.data.shape[0] > 1 else p.data.shape[1],
                     p.shape[0], p.rows.data_ptr() if p.rows is not None else 0]
        self.packed = torch.tensor(desc, dtype=torch.int64)
        self.bias = bias.detach().to(torch.float32).contiguous() if bias is not None else None
        self.activations = "bf16" if bf16 else "int8" if int8 else "fp32"
        entry = f"gguf_linear_{'amx' if bf16 else 'q8' if int8 else 'f32'}"
        self._fn = bind(lib, entry, None, *[PTR] * 4, I64, I64, I64, ctypes.c_int) if lib else None
        self.kernel: int = ctypes.cast(self._fn, PTR).value if self._fn is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [M, {self.in_features}] input, got {list(x.shape)}")
        x = x.to(torch.float32).contiguous()
        if self._fn is None:  # reference path: dequantize, then torch's matmul
            w = torch.cat([dequantize(p) for p in self._parts])
            return torch.nn.functional.linear(x, w, self.bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                     y.data_ptr(), x.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return y


def _library() -> ctypes.CDLL | None:
    return library("gguf_linear", "GGUF linear-layer")


_AMX: dict[int, bool] = {}


def int8_rows() -> int:
    """Rows of x up to which ``int8=True`` quantizes them (the kernel build's: 64 with AVX-512
    VNNI, 16 otherwise); 0 without the native library."""
    lib = _library()
    return int(bind(lib, "gguf_q8_rows", ctypes.c_int)()) if lib is not None else 0


def amx_available() -> bool:
    """Whether the bf16 tile path runs here: the kernels were built for a CPU with AMX-BF16 and
    Linux grants this process the tile state (asked once per library)."""
    lib = _library()
    if lib is None:
        return False
    if id(lib) not in _AMX:
        _AMX[id(lib)] = bool(bind(lib, "gguf_amx_ready", ctypes.c_int)())
    return _AMX[id(lib)]


def gguf_linear(parts: list[QuantTensor], bias: torch.Tensor | None = None, bf16: bool = False,
                int8: bool = False) -> GGUFLinear | None:
    """The parts (concatenated along N) as one linear layer, or None when the native library
    cannot be built here. ``bf16``: multiply five rows of x or more in bf16 on AMX tiles where
    the CPU has them (``amx_available``), else ignored. ``int8``: up to ``int8_rows()`` rows of x quantized
    to int8 against the Q8_0 / Q4_0 / Q5_0 / Q4_K / Q5_K / Q6_K parts (see the module doc); where
    ``bf16`` is granted too, bf16 wins. Raises ``ValueError`` (one line) for a
    type the kernels do not serve, K not a multiple of the block size, parts of different K, or
    a bias of the wrong shape."""
    if not parts:
        raise ValueError("gguf_linear needs at least one part")
    for i, p in enumerate(parts):
        p.check(f"part {i}")
        if p.shape[1] != parts[0].shape[1]:
            raise ValueError(f"part {i}: {p.shape[1]} inputs, part 0 has {parts[0].shape[1]}")
    n = sum(p.shape[0] for p in parts)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias: expected [{n}], got {list(bias.shape)}")
    lib = _library()
    if lib is None:
        return None
    tiles = bf16 and amx_available()
    return GGUFLinear(lib, parts, bias, bf16=tiles, int8=int8 and not tiles)


_ROWS_FN: dict[int, ctypes._CFuncPtr] = {}


def gguf_rows(t: QuantTensor, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup: fp32 ``[T, K]`` rows ``ids`` of ``t`` (honours ``t.rows``), rebuilt
    exactly as ``dequantize`` rebuilds them."""
    t.check()
    phys = t.physical(ids).contiguous()
    lib = _library()
    if lib is None:
        return _dequantize_numpy(t, phys)
    out = torch.empty(phys.numel(), t.shape[1], dtype=torch.float32)
    fn = _ROWS_FN.get(id(lib))
    if fn is None:  # bound once: an embedding lookup runs every step
        fn = _ROWS_FN[id(lib)] = bind(lib, "gguf_dequant_rows", ctypes.c_int, I64, PTR, I64, PTR, I64, I64, PTR)
    stride = t.data.stride(0) if t.data.shape[0] > 1 else t.data.shape[1]
    if fn(t.qtype, t.data.data_ptr(), stride, phys.data_ptr(), phys.numel(), t.shape[1], out.data_ptr()) != 0:
        raise ValueError(unsupported_error(t.qtype, "tensor"))
    return out
