"""A bf16 checkpoint on the CPU, computed in float32 with its projections kept as bf16 rows.

The native CPU kernels compute in float32; a bf16 checkpoint loaded as float32 would hold four
bytes a weight. Instead it loads in bf16 (two bytes a weight, as stored) and everything but the
``nn.Linear`` weights and a mixture of experts' 3-D matrices (norms, embeddings, biases, buffers)
is widened to float32 at once; each projection the fused forward takes is then kept as its bf16 rows, read by
the GGUF kernels' exact BF16 path (``native.ops.bf16_linear``: each weight widened exactly, the
same float32 products), and so is the input embedding (``Embedding``: looked up as float32 rows;
a tied head shares its rows). A weight nothing took (a vision tower's, or every one when the fused
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
    """Every floating parameter and buffer of ``model`` in float32 but the ``nn.Linear`` weights,
    the experts' 3-D matrices and the token tables (left in bf16 for the kernels to take as they
    are; ``widen_leftovers`` widens what none took)."""
    from .moe import moe_parts

    others = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    keep = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - others
    for m in model.modules():
        if (sp := moe_parts(m)) is not None:
            keep |= {id(sp.experts.gate_up_proj), id(sp.experts.down_proj)}
        # Other experts' 3-D matrices (Gemma 4's, beside its dense MLP) and other token tables (its
        # per-layer embeddings): the fused forward reads them as bf16 rows too, or they are widened after.
        experts = [getattr(m, n, None) for n in ("gate_up_proj", "down_proj")]
        if all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in experts):
            keep |= {id(t) for t in experts}
        if type(m).__name__.endswith("Embedding") and isinstance(getattr(m, "weight", None), torch.Tensor):
            keep.add(id(m.weight))  # (the input one: ``Embedding``'s rows, shared with a tied head)
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


class Embedding:
    """The language model's input embedding as bf16 rows the GGUF kernels read (a copy of its
    own), looked up as float32 rows (times Gemma's scale, as its module multiplies), and, where the
    output head is tied to it, the head over the same rows: one bf16 copy for both."""

    def __init__(self, model: Any) -> None:
        from .native.gguf_ops import BF16, QuantTensor, gguf_rows

        self._lookup = gguf_rows  # bound once: a lookup runs every step
        module = model.get_input_embeddings()
        weight = module.weight.detach()
        self.module = module
        self.rows = QuantTensor(qtype=BF16, data=weight.to(torch.bfloat16, copy=True).view(torch.uint8),
                                shape=(weight.shape[0], weight.shape[1]))
        scale = getattr(module, "scalar_embed_scale", None)
        self.factor = torch.tensor(float(scale), dtype=torch.float32) if scale is not None else None
        head = model.get_output_embeddings()
        self.tied = head is not None and getattr(head, "weight", None) is module.weight

    @classmethod
    def of(cls, model: Any) -> "Embedding | None":
        """For a model loaded with bf16 rows (its embedding left bf16), else None."""
        module = model.get_input_embeddings()
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return None
        return cls(model)

    def head(self, bias: torch.Tensor | None) -> Any:
        """The tied head over these rows (a ``gguf_ops.GGUFLinear``), or None."""
        from .native.gguf_ops import gguf_linear

        return gguf_linear([self.rows], bias) if self.tied else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(self.rows, ids)
        return out if self.factor is None else out.mul_(self.factor)

    def take(self, fused: Any) -> None:
        """The fused forward looks its tokens up here; the module's own weight goes (the rows hold it)."""
        fused.embed = self
        self.module.weight.data = self.module.weight.data.new_empty(0)
