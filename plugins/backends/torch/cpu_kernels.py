"""Native CPU kernels for the torch backend, compiled on first use with the system C compiler.

Only what plain torch does badly on a CPU lives here: decode attention read straight from the
paged KV pool (``csrc/paged_decode.c``), fp32 linear layers over few rows with weights packed
for the kernel, as fp32 or, where that is lossless, 4- or 8-bit panels (``csrc/packed_linear.c``) and the fused forward's small per-layer operations
(``csrc/elementwise.c``); the last two need AVX2 + FMA. ``csrc/decoder_step.c`` (driven by
``native_step.py``) runs a whole decode step over those kernels in one call. Each shared
library is built once per source, compiler flags and machine into ``~/.cache/llmserve/kernels``
(``LLMSERVE_KERNEL_CACHE`` overrides it; a per-user temp folder when home is not writable) and
loaded with ctypes, so
there is no build step at install time and nothing to ship per CPU. Without a compiler, on a
CPU the kernel does not support, or with ``LLMSERVE_CPU_KERNELS=0``, ``decode_kernel()``,
``packed_linear()`` and ``elementwise_ops()`` return None and the backend keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import switches

log = logging.getLogger("llmserve.backend.torch")

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
DecodeKernel = Callable[..., None]
_loaded: dict[str, Any] = {}


def _cache_dir() -> Path:
    """``$LLMSERVE_KERNEL_CACHE``, else ``~/.cache/llmserve/kernels``, else (no writable home,
    e.g. a locked-down service user) a per-user folder under the system temp dir."""
    explicit = os.environ.get("LLMSERVE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    home = Path.home() / ".cache" / "llmserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"llmserve-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _build(compiler: str, name: str) -> Path:
    path = _CSRC / f"{name}.c"
    # Shared headers are part of every kernel's source as far as the cache is concerned.
    source = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))
    # The key covers everything that changes the binary: source, flags, compiler, CPU model.
    cpu = platform.machine() + platform.processor()
    try:
        cpu += next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        pass
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, cpu]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernel %s (once per machine) into %s", name, target.parent)
    # Build next to the target and rename: concurrent first starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(path), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "compiler failed")
        os.replace(out, target)
    return target


def _library(name: str, what: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built and loaded, or None when it cannot be had here (logged once)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if not switches.enabled(switches.CPU_KERNELS):
            log.info("native CPU kernels disabled by LLMSERVE_CPU_KERNELS: %s stays on the torch path", what)
        elif not (compiler := os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
            log.info("no C compiler found: %s stays on the torch path", what)
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler, name)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("the CPU %s kernel is unavailable (%s); using the torch path", what, exc)
        _loaded[name] = lib
        return lib


def _bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> ctypes._CFuncPtr:
    """``lib.name`` with its C signature declared."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _row_head_strides(t: torch.Tensor, name: str) -> tuple[int, int]:
    """Row and head strides of a ``[rows, heads, D]`` fp32 CPU view whose head vectors are contiguous."""
    if t.dim() != 3 or t.stride(2) != 1 or t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a [rows, heads, D] fp32 CPU view with contiguous head vectors")
    return t.stride(0), t.stride(1)


def decode_kernel() -> DecodeKernel | None:
    """The paged decode-attention function, or None when it cannot be had here."""
    lib = _library("paged_decode", "decode-attention")
    if lib is None:
        return None
    cfn = _bind(lib, "paged_decode_f32", _INT, _PTR, _I64, _I64, *[_PTR] * 4, _I64, *[_I64] * 7, _F32, _I64, _INT)

    def paged_decode(q: torch.Tensor, blocks_view: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                     out: torch.Tensor, scale: float, window: int | None) -> None:
        """``q``/``out [nd, H, D]`` (any row and head strides for q, e.g. a view of a fused QKV
        output; ``out`` with contiguous rows), ``blocks_view [2*kvh, nblocks, bs, D]``,
        ``tables [nd * max_blocks]`` and ``ctx [nd]`` (int64), all on the CPU."""
        nd, H, D = q.shape
        q_row, q_head = _row_head_strides(q, "q")
        out_row, out_head = _row_head_strides(out, "out")
        if out_head != D or out.shape != q.shape:
            raise ValueError("out: expected [nd, H, D] with contiguous heads")
        two_kvh, nblocks, bs, pool_d = blocks_view.shape
        if pool_d != D or H % max(two_kvh // 2, 1) or not blocks_view.is_contiguous():
            raise ValueError("paged_decode: the pool's head size or KV heads do not match the queries")
        rc = cfn(q.data_ptr(), q_row, q_head, blocks_view.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                 out.data_ptr(), out_row, nd, H, two_kvh // 2, D, nblocks, bs, tables.numel() // max(nd, 1),
                 scale, window or 0, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")

    return paged_decode


def kv_writer() -> Callable[..., None] | None:
    """The native KV write (the step's keys and values into their pool slots), or None."""
    lib = _library("paged_decode", "decode-attention")
    if lib is None:
        return None
    cfn = _bind(lib, "write_kv_f32", _INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, *[_I64] * 4, _PTR)

    def write_kv(slots_view: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``slots_view [2*kvh, nslots, D]`` (contiguous) gets ``k``/``v [T, kvh, D]`` at
        ``slot_mapping [T]`` (int64); k and v may be strided views with contiguous heads."""
        two_kvh, nslots, D = slots_view.shape
        T, kvh, head_dim = k.shape
        k_row, k_head = _row_head_strides(k, "k")
        v_row, v_head = _row_head_strides(v, "v")
        if (v.shape != k.shape or two_kvh != 2 * kvh or head_dim != D or not slots_view.is_contiguous()
                or slot_mapping.numel() != T):
            raise ValueError("write_kv: mismatched shapes")
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            raise ValueError("write_kv: slot_mapping must be contiguous int64")
        if cfn(k.data_ptr(), k_row, k_head, v.data_ptr(), v_row, v_head, slot_mapping.data_ptr(), T, kvh, D, nslots,
               slots_view.data_ptr()) != 0:
            raise IndexError("write_kv: a slot is outside the KV pool")

    return write_kv


_QK = 32  # k per block of a quantized panel (csrc/packed_linear.c's QK)
# Per code width: the largest code a block's spread divides into (tried in turn: rounding or a
# narrow block may leave the top code unused), and the code range.
_TOPS = {4: (15, 14, 13, 12), 8: (127, 126, 125)}
_CODES = {4: (0, 15), 8: (-128, 127)}


def _code_blocks(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row and per 32 consecutive k of ``weight [N, K]``: a scale d, an offset m and codes
    q with every weight equal to ``d * q + m`` bit for bit, or None when some block has none.
    4 bits: q in 0..15 and m the block's minimum (a GGUF Q4_1 block dequantized to fp32);
    8 bits: q in -128..127 and m = 0 (GGUF Q8_0). d is searched among fp16 numbers near the
    block's spread over its top code, whose products with q are exact in fp32, so the check
    here rounds like the kernel.
    """
    N, K = weight.shape
    if N == 0 or K % _QK:
        return None
    blocks = weight.reshape(-1, _QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        return None
    if bits == 8:
        hi, lo = torch.maximum(hi, -lo), torch.zeros_like(lo)
    qmin, qmax = _CODES[bits]
    d = torch.zeros_like(lo)
    q = torch.zeros(blocks.shape, dtype=torch.uint8 if bits == 4 else torch.int8)
    done = torch.zeros(lo.shape, dtype=torch.bool)
    for top, offset in ((top, offset) for top in _TOPS[bits] for offset in (0, 1, -1, 2, -2)):
        todo = (~done).nonzero().squeeze(1)
        if not todo.numel():
            break
        bits16 = ((hi[todo] - lo[todo]) / top).to(torch.float16).view(torch.int16)
        scale = (bits16 + offset).view(torch.float16).float()
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.zeros_like(scale))
        base, target = lo[todo, None], blocks[todo]
        codes = torch.round((target - base) / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(qmin, qmax)
        codes = codes * (scale > 0)[:, None] + 0.0  # a flat block: d = 0, every code 0; no -0.0 codes
        rebuilt = scale[:, None] * codes + base if bits == 4 else scale[:, None] * codes
        ok = (rebuilt.view(torch.int32) == target.view(torch.int32)).all(-1)
        hit = todo[ok]
        d[hit], q[hit], done[hit] = scale[ok], codes[ok].to(q.dtype), True
    if not done.all():
        return None
    return d.view(N, -1), lo.view(N, -1), q.view(N, -1, _QK)


def _pack_codes(lib: ctypes.CDLL, weight: torch.Tensor, panels_f32: torch.Tensor, bits: int) -> torch.Tensor | None:
    """``weight`` as 4- or 8-bit panels (csrc/packed_linear.c's layout), or None unless they
    unpack to exactly ``panels_f32`` (its fp32 panels), bit for bit."""
    N, K = weight.shape
    if N > 64 and _code_blocks(weight[:64], bits) is None:  # most matrices that do not fit fail here, cheaply
        return None
    found = _code_blocks(weight, bits)
    if found is None:
        return None
    d, m, q = found
    panels, pad = -(-N // 16), -N % 16
    if pad:
        d, m = F.pad(d, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
    kb = K // _QK

    def by_block(t: torch.Tensor) -> torch.Tensor:  # [N, kb] fp32 -> [P, kb, 64] bytes
        return t.view(panels, 16, kb).transpose(1, 2).contiguous().view(torch.uint8)

    q = q.view(panels, 16, kb, _QK).permute(0, 2, 3, 1)                      # [P, kb, 32 k, 16 columns]
    if bits == 4:
        parts = [by_block(d), by_block(m), (q[..., :8] | (q[..., 8:] << 4)).reshape(panels, kb, _QK * 8)]
    else:
        parts = [by_block(d), q.contiguous().view(torch.uint8).reshape(panels, kb, _QK * 16)]
    packed = torch.cat(parts, dim=-1).reshape(-1).contiguous()
    back = torch.empty_like(panels_f32)
    _bind(lib, "unpack_quantized", None, _PTR, _PTR, _I64, _I64, _INT)(packed.data_ptr(), back.data_ptr(), N, K, bits)
    return packed if torch.equal(back.view(torch.int32), panels_f32.view(torch.int32)) else None


class PackedLinear:
    """``y = x @ weight.T + bias`` for fp32 CPU inputs, with ``weight [N, K]`` copied once into
    the kernel's panel layout. Callable like ``F.linear`` on a 2-D ``[M, K]`` input, for any M.

    ``format`` is ``"q4"`` or ``"q8"`` when the weights are stored as 4-bit or 8-bit codes
    with a scale (and, for 4 bits, an offset) per 32 inputs of a column, which happens only
    where those reproduce every fp32 weight bit for bit (a model dequantized from GGUF Q4_1
    or Q8_0 blocks, for one): 0.75 or 1.125 bytes per weight instead of 4, and the same output
    bits. Otherwise, and with ``LLMSERVE_COMPACT_WEIGHTS=0``, ``"f32"``. ``kernel`` is the
    address of the C function that reads this format (the native decoder step calls it).
    """

    __slots__ = ("_fn", "kernel", "format", "packed", "bias", "out_features", "in_features")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.detach().contiguous()
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // 16)
        f32 = torch.empty(panels * self.in_features * 16, dtype=torch.float32)
        pack = _bind(lib, "pack_weight_f32", None, _PTR, _PTR, _I64, _I64)
        pack(weight.data_ptr(), f32.data_ptr(), self.out_features, self.in_features)
        self.format, self.packed = "f32", f32
        if switches.enabled(switches.COMPACT_WEIGHTS):
            for bits in (4, 8):
                codes = _pack_codes(lib, weight, f32, bits)
                if codes is not None:
                    self.format, self.packed = f"q{bits}", codes
                    break
        self.bias = bias.detach().contiguous() if bias is not None else None
        self._fn = _bind(lib, f"packed_linear_{self.format}", None, *[_PTR] * 4, _I64, _I64, _I64, _INT)
        self.kernel: int = ctypes.cast(self._fn, _PTR).value

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected [M, {self.in_features}] input, got {list(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), self.packed.data_ptr(), self.bias.data_ptr() if self.bias is not None else None,
                     y.data_ptr(), x.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return y


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """``weight`` (and ``bias``) packed for the native linear kernel, or None when the kernel is
    unavailable here or does not apply (only fp32 weights on the CPU do)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None
    lib = _library("packed_linear", "linear-layer")
    return PackedLinear(lib, weight, bias) if lib is not None else None


class ElementwiseOps:
    """The fused forward's per-layer small operations on contiguous fp32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = _bind(lib, "add_rms_norm_f32", None, *[_PTR] * 4, _I64, _I64, _F32, _INT)
        self._silu = _bind(lib, "silu_mul_f32", None, _PTR, _PTR, _I64, _I64, _INT)
        self._rope = _bind(lib, "rope_f32", None, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT)
        self._greedy = _bind(lib, "greedy_pick_f32", _I64, _PTR, _I64, _I64, _PTR, _PTR, _INT)

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
        T, two_i = gu.shape
        if not gu.is_contiguous() or two_i % 2:
            raise ValueError("silu_mul needs a contiguous [T, 2 * I] tensor")
        out = gu.new_empty(T, two_i // 2)
        self._silu(gu.data_ptr(), out.data_ptr(), T, two_i // 2, torch.get_num_threads())
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
    lib = _library("elementwise", "elementwise")
    return ElementwiseOps(lib) if lib is not None else None
