"""The lossless 4- and 8-bit panel search: weights stored as codes only where they rebuild bit for bit.

Per output column and per 32 consecutive inputs, 4 bits keep a scale and an offset (a GGUF Q4_1
block), 8 bits a scale (a GGUF Q8_0 block); ``pack_codes`` lays them out like
``csrc/packed_linear.c`` expects and keeps them only if the kernel's own unpacking gives the fp32
panels back exactly.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .build import INT, I64, PTR, bind

QK = 32  # k per block of a quantized panel (csrc/packed_linear.c's QK)
# Per code width: the largest code a block's spread divides into (tried in turn: rounding or a
# narrow block may leave the top code unused), and the code range.
_TOPS = {4: (15, 14, 13, 12), 8: (127, 126, 125)}
_CODES = {4: (0, 15), 8: (-128, 127)}


def code_blocks(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row and per 32 consecutive k of ``weight [N, K]``: a scale d, an offset m and codes
    q with every weight equal to ``d * q + m`` bit for bit, or None when some block has none.
    4 bits: q in 0..15 and m the block's minimum (a GGUF Q4_1 block dequantized to fp32);
    8 bits: q in -128..127 and m = 0 (GGUF Q8_0). d is searched among fp16 numbers near the
    block's spread over its top code, whose products with q are exact in fp32, so the check
    here rounds like the kernel.
    """
    N, K = weight.shape
    if N == 0 or K % QK:
        return None
    blocks = weight.reshape(-1, QK)
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
    return d.view(N, -1), lo.view(N, -1), q.view(N, -1, QK)


def pack_codes(lib: ctypes.CDLL, weight: torch.Tensor, panels_f32: torch.Tensor, bits: int) -> torch.Tensor | None:
    """``weight`` as 4- or 8-bit panels (csrc/packed_linear.c's layout), or None unless they
    unpack to exactly ``panels_f32`` (its fp32 panels), bit for bit."""
    N, K = weight.shape
    if N > 64 and code_blocks(weight[:64], bits) is None:  # most matrices that do not fit fail here, cheaply
        return None
    found = code_blocks(weight, bits)
    if found is None:
        return None
    d, m, q = found
    panels, pad = -(-N // 16), -N % 16
    if pad:
        d, m = F.pad(d, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
    kb = K // QK

    def by_block(t: torch.Tensor) -> torch.Tensor:  # [N, kb] fp32 -> [P, kb, 64] bytes
        return t.view(panels, 16, kb).transpose(1, 2).contiguous().view(torch.uint8)

    q = q.view(panels, 16, kb, QK).permute(0, 2, 3, 1)                      # [P, kb, 32 k, 16 columns]
    if bits == 4:
        parts = [by_block(d), by_block(m), (q[..., :8] | (q[..., 8:] << 4)).reshape(panels, kb, QK * 8)]
    else:
        parts = [by_block(d), q.contiguous().view(torch.uint8).reshape(panels, kb, QK * 16)]
    packed = torch.cat(parts, dim=-1).reshape(-1).contiguous()
    back = torch.empty_like(panels_f32)
    bind(lib, "unpack_quantized", None, PTR, PTR, I64, I64, INT)(packed.data_ptr(), back.data_ptr(), N, K, bits)
    return packed if torch.equal(back.view(torch.int32), panels_f32.view(torch.int32)) else None
