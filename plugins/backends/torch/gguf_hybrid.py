"""The layers of hybrid GGUF files as ``fused_hybrid.HybridDecoder`` takes them: ``qwen35``,
``qwen35moe`` and ``qwen3next`` (Gated DeltaNet and gated attention layers, dense MLPs or experts)
and ``lfm2`` (short-convolution and attention layers), with the names and layouts llama.cpp's
converter gives them. Row maps pick interleaved rows apart (each attention head's query and gate
rows; Qwen3-Next's ``b`` and ``a``) without copying the file's blocks; every small tensor is
checked against the configuration, and a missing or mis-shaped one is refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve import ConfigError, progress

from .gguf_model import _Mapper
from .moe import moe_parts
from .recurrent import DeltaNetParams, ShortConvParams

# A layer's two norms: the skeleton's module -> the GGUF tensor within block N.
_NORMS = {"lfm2": {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm"}}
_QWEN_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"}


def _rows(heads: int, size: int, pick: int) -> torch.Tensor:
    """The rows ``pick`` (0 or 1) of each head's two interleaved blocks of ``size`` rows."""
    first = torch.arange(heads, dtype=torch.int32)[:, None] * (2 * size) + size * pick
    return (first + torch.arange(size, dtype=torch.int32)[None, :]).reshape(-1).contiguous()


class HybridMapper(_Mapper):
    """``_Mapper`` for the hybrid architectures: each layer's parts as ``HybridDecoder`` takes them."""

    def final_norm(self, base: Any) -> None:
        if self.f.architecture == "lfm2":  # LFM2's final norm is filed as the embedding's
            self.fill(base.embedding_norm, "token_embd_norm.weight")
        else:
            super().final_norm(base)

    def layer(self, i: int, dec: Any, permuted: bool) -> dict[str, Any]:
        """Layer ``i``: its norms filled in, then its token mixer's parts (``delta``, ``conv`` or
        the attention's) and its MLP's or experts' products."""
        blk, lfm2 = f"blk.{i}.", self.f.architecture == "lfm2"
        for module, tensor in _NORMS.get(self.f.architecture, _QWEN_NORMS).items():
            self.fill(getattr(dec, module), f"{blk}{tensor}.weight")
        mlp = dec.feed_forward if lfm2 else dec.mlp
        if moe_parts(mlp) is not None:
            out: dict[str, Any] = self.experts(blk)
        else:
            hidden, inter = int(self.cfg.hidden_size), int((mlp.w1 if lfm2 else mlp.gate_proj).out_features)
            out = {"gu": self.linear([f"{blk}ffn_gate.weight", f"{blk}ffn_up.weight"], shapes=[(inter, hidden)] * 2),
                   "down": self.linear([f"{blk}ffn_down.weight"], shapes=[(hidden, inter)])}
        if hasattr(dec, "linear_attn"):
            return out | self.delta_layer(i, dec.linear_attn)
        if hasattr(dec, "conv"):
            return out | self.conv_layer(i, dec.conv)
        return out | (self.plain_attention(blk, dec.self_attn) if lfm2 else self.gated_attention(blk, dec.self_attn))

    def small(self, blk: str, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """The layer's small tensors ``sizes`` (name within the block -> values), each checked."""
        small = {n: self.f.vector(self.need(blk + n)) for n in sizes}
        if wrong := [n for n, size in sizes.items() if small[n].numel() != size]:
            raise ConfigError(f"GGUF tensor {blk}{wrong[0]} has {small[wrong[0]].numel()} values where a "
                              f"{self.f.architecture} model of this configuration has {sizes[wrong[0]]} (the file "
                              "is inconsistent)")
        return small

    def shaped(self, name: str, t: Any, rows: int) -> None:
        hidden = int(self.cfg.hidden_size)
        if tuple(t.shape) != (rows, hidden):
            raise ConfigError(f"GGUF tensor {name} is {t.shape[0]} x {t.shape[1]}; a {self.f.architecture} model of "
                              f"this configuration has {rows} x {hidden} (the file is inconsistent)")

    def interleaved(self, name: str, heads: int, size: int, what: str) -> tuple[Any, Any]:
        """The matrix ``name`` whose rows hold, per head, ``size`` rows of one kind then ``size``
        of the other, as two products' parts (row maps into the file's rows; ``what`` names them)."""
        f, hidden = self.f, int(self.cfg.hidden_size)
        if tuple(int(d) for d in f.tensors[self.need(name)].shape) != (hidden, 2 * heads * size):
            raise ConfigError(f"GGUF tensor {name} is not {2 * heads * size} x {hidden} ({what}): the file is "
                              "inconsistent")
        first, second = (f.quant(name, _rows(heads, size, g)) for g in (0, 1))
        return first, second

    def delta_layer(self, i: int, m: Any) -> dict[str, Any]:
        """A Gated DeltaNet layer: its state's small tensors, its input projections in one product
        (``qwen3next``: ``delta_inputs``), its output projection."""
        blk, hidden = f"blk.{i}.", int(self.cfg.hidden_size)
        hk, hv, dk, dv, kernel = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel_size
        channels = 2 * hk * dk + hv * dv
        small = self.small(blk, {"ssm_conv1d.weight": channels * kernel, "ssm_a": hv, "ssm_dt.bias": hv,
                                 "ssm_norm.weight": dv})
        grouped = self.f.architecture == "qwen3next"  # value heads by key head; b and a in one tensor
        delta = DeltaNetParams(layer=i, conv=small["ssm_conv1d.weight"].view(channels, kernel), neg_a=small["ssm_a"],
                               dt_bias=small["ssm_dt.bias"], norm=small["ssm_norm.weight"],
                               eps=float(self.cfg.rms_norm_eps), key_heads=hk, value_heads=hv, key_dim=dk,
                               value_dim=dv, tiled=not grouped)
        proj = self.delta_inputs(blk, channels, hv * dv, hk, hv // hk) if grouped else self.linear(
            [f"{blk}{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")],
            shapes=[(channels, hidden), (hv * dv, hidden), (hv, hidden), (hv, hidden)])
        return {"delta": delta, "proj": proj, "out": self.linear([f"{blk}ssm_out.weight"], shapes=[(hidden, hv * dv)])}

    def delta_inputs(self, blk: str, channels: int, values: int, key_heads: int, per_key: int) -> Any:
        """A ``qwen3next`` Gated DeltaNet layer's input projections in one product: ``attn_qkv``,
        ``attn_gate``, then ``ssm_ba``'s rows (each key head's ``b`` rows, then its ``a`` rows)
        picked apart by row maps into every ``b``, then every ``a``."""
        f = self.f
        b, a = self.interleaved(f"{blk}ssm_ba.weight", key_heads, per_key,
                                f"b and a of {key_heads * per_key} value heads")
        qkv, gate = (f.quant(self.need(f"{blk}{n}.weight")) for n in ("attn_qkv", "attn_gate"))
        self.shaped(f"{blk}attn_qkv.weight", qkv, channels)
        self.shaped(f"{blk}attn_gate.weight", gate, values)
        lin = self.product([qkv, gate, b, a], None, f"{blk}attn_qkv.weight")
        progress.advance(3)
        return lin

    def conv_layer(self, i: int, m: Any) -> dict[str, Any]:
        """An LFM2 short-convolution layer: the depthwise convolution (``[channels, L]``) and its
        bias, ``B``, ``C`` and ``x`` in one product, the output projection (biased where the file
        has biases)."""
        blk, hidden, kernel = f"blk.{i}.", int(self.cfg.hidden_size), int(m.conv_kernel_size)
        weight = self.small(blk, {"shortconv.conv.weight": hidden * kernel})["shortconv.conv.weight"]
        bias = {n: self.small(blk, {f"shortconv.{n}.bias": size})[f"shortconv.{n}.bias"]
                if f"{blk}shortconv.{n}.bias" in self.f else None
                for n, size in (("conv", hidden), ("in_proj", 3 * hidden), ("out_proj", hidden))}
        return {"conv": ShortConvParams(layer=i, weight=weight.view(hidden, kernel), bias=bias["conv"]),
                "proj": self.linear([f"{blk}shortconv.in_proj.weight"], bias=bias["in_proj"],
                                    shapes=[(3 * hidden, hidden)]),
                "out": self.linear([f"{blk}shortconv.out_proj.weight"], bias=bias["out_proj"],
                                   shapes=[(hidden, hidden)])}

    def plain_attention(self, blk: str, attn: Any) -> dict[str, Any]:
        """LFM2's attention: queries, keys and values in one product (rows as the checkpoint's),
        each head's norms, the output projection."""
        hidden, H, kvh = int(self.cfg.hidden_size), self.heads, self.kv_heads
        D = int(attn.head_dim)
        self.fill(attn.q_layernorm, f"{blk}attn_q_norm.weight")
        self.fill(attn.k_layernorm, f"{blk}attn_k_norm.weight")
        return {"proj": self.linear([f"{blk}attn_{p}.weight" for p in "qkv"],
                                    shapes=[(H * D, hidden), (kvh * D, hidden), (kvh * D, hidden)]),
                "out": self.linear([f"{blk}attn_output.weight"], shapes=[(hidden, H * D)])}

    def gated_attention(self, blk: str, attn: Any) -> dict[str, Any]:
        """Qwen's gated attention: queries, keys, values and gates in one product (each head's
        query rows and gate rows, interleaved in ``attn_q``, picked apart by row maps), each head's
        norms, the output projection."""
        f, hidden, H, kvh = self.f, int(self.cfg.hidden_size), self.heads, self.kv_heads
        D = int(self.cfg.head_dim)
        for norm in ("q_norm", "k_norm"):
            self.fill(getattr(attn, norm), f"{blk}attn_{norm}.weight")
        q_name = f"{blk}attn_q.weight"
        q, gate = self.interleaved(q_name, H, D, f"queries and gates of {H} heads of {D}")
        k, v = (f.quant(self.need(f"{blk}attn_{p}.weight")) for p in ("k", "v"))
        self.shaped(f"{blk}attn_k.weight", k, kvh * D)
        self.shaped(f"{blk}attn_v.weight", v, kvh * D)
        proj = self.product([q, k, v, gate], None, q_name)
        progress.advance(3)
        return {"proj": proj, "out": self.linear([f"{blk}attn_output.weight"], shapes=[(hidden, H * D)])}
