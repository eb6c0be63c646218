"""A bf16 checkpoint on the CPU, computed in float32 with its projections kept as bf16 rows.

The native CPU kernels compute in float32; a bf16 checkpoint loaded as float32 would hold four
bytes a weight. Instead it loads in bf16 (two bytes a weight, as stored) and everything but the
``nn.Linear`` weights and a mixture of experts' 3-D matrices (norms, embeddings, biases, buffers)
is widened to float32 at once; each projection the fused forward takes is then kept as its bf16 rows, read by
the GGUF kernels' exact BF16 path (``native.ops.bf16_linear``: each weight widened exactly, the
same float32 products). A linear nothing took (a vision tower's, or every one when the fused
forward does not apply) is widened afterwards (``widen_leftovers``), so every path computes in
float32 either way and the peak memory is the checkpoint's, not twice it.
"""

from __future__ import annotations

from typing import Any

import torch


def applies(device: torch.device, dtype_option: str | None, stored: str | None) -> bool:
    """Whether a load keeps bf16 rows: a bf16 checkpoint on the CPU computed in float32, asked
    for (``--dtype float32``) or chosen (``auto`` on a CPU without bf16 tiles, where it is faster
    than bf16 arithmetic for the same memory: on the 0.8B Qwen3.5 shape a decode step of 29.5 ms
    against 63), with the GGUF kernels built here to read them."""
    option = (dtype_option or "auto").lower()
    if device.type != "cpu" or stored != "bfloat16" or option not in ("auto", "float32"):
        return False
    from .gguf_model import _kernels_available

    return _kernels_available() and (option == "float32" or not bf16_tiles())


def bf16_tiles() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (there ``auto`` keeps bf16 arithmetic)."""
    from .native.gguf_ops import amx_available

    return amx_available()


def widen_all_but_linears(model: Any) -> None:
    """Every floating parameter and buffer of ``model`` in float32 but the ``nn.Linear`` weights
    and a mixture of experts' 3-D matrices (left in bf16 for the kernels to take as they are); a
    weight an embedding shares with a linear (tied embeddings) is widened too, since the embedding
    reads it directly."""
    from .moe import moe_parts

    others = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    keep = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - others
    for m in model.modules():
        if (sp := moe_parts(m)) is not None:
            keep |= {id(sp.experts.gate_up_proj), id(sp.experts.down_proj)}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32 and id(p) not in keep:
                p.data = p.data.float()
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point() and b.dtype != torch.float32:
                setattr(module, name, b.float())


def widen_leftovers(model: Any) -> int:
    """Widen to float32 each weight still held in bf16 (one no kernel took: a vision tower's, or
    all of them without the fused forward); how many."""
    count = 0
    for p in model.parameters():
        if p.dtype == torch.bfloat16 and p.numel():
            p.data = p.data.float()
            count += 1
    return count
