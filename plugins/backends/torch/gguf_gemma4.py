"""The layers of a Gemma 4 GGUF file (``gemma4``, as llama.cpp's converter writes it) as Gemma 4's
fused forward takes them (``fused_gemma4.Gemma4Decoder``): per layer the query (and, in the layers
that keep their own, key and value) projections, the sandwich norms and the per-head q/k norms
as stored (no ``1 +``), the layer's output scale (``layer_output_scale``), the per-layer-embedding
gate and projection (``inp_gate``, ``proj``, ``post_norm``), and in a MoE file the experts beside
the dense MLP (``ffn_gate_up_exps``, ``ffn_down_exps`` with its per-expert ``scale``, the router
``ffn_gate_inp`` with its input ``scale``, and their norms ``pre_ffw_norm_2``, ``post_ffw_norm_1``
and ``post_ffw_norm_2``); for the model the per-layer token table (``per_layer_token_embd``) and
its projection (``per_layer_model_proj``, ``per_layer_proj_norm``)."""

from __future__ import annotations

from typing import Any

import torch

from llmserve import ConfigError

from .gguf_model import _Mapper, _parameter

_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_MOE_NORMS = {"pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
              "post_feedforward_layernorm_2": "post_ffw_norm_2"}


class Gemma4Mapper(_Mapper):
    """``_Mapper`` for the ``gemma4`` architecture (its tensors' names and shapes above)."""

    def small(self, module: Any, attr: str, name: str, size: int) -> None:
        """A vector the model keeps as a parameter or buffer other than a norm's weight."""
        value = self.f.vector(self.need(name))
        if value.numel() != size:
            raise ConfigError(f"GGUF tensor {name} has {value.numel()} values where a gemma4 model of this "
                              f"configuration has {size} (the file is inconsistent)")
        if attr == "layer_scalar":
            module.layer_scalar = value  # (a buffer)
        else:
            _parameter(module, attr, value)

    def layer(self, i: int, dec: Any, permuted: bool) -> dict[str, Any]:
        blk, attn, cfg = f"blk.{i}.", dec.self_attn, self.cfg
        hidden, D = int(cfg.hidden_size), int(attn.head_dim)
        for module, tensor in _NORMS.items():
            self.fill(getattr(dec, module), f"{blk}{tensor}.weight")
        self.fill(attn.q_norm, f"{blk}attn_q_norm.weight")
        self.small(dec, "layer_scalar", f"{blk}layer_output_scale.weight", 1)
        q = [(f"{blk}attn_q.weight", (self.heads * D, hidden))]
        if not attn.is_kv_shared_layer:
            self.fill(attn.k_norm, f"{blk}attn_k_norm.weight")
            kv = (int(attn.k_proj.weight.shape[0]), hidden)
            q.append((f"{blk}attn_k.weight", kv))
            if attn.v_proj is not None:
                q.append((f"{blk}attn_v.weight", kv))
        inter = int(dec.mlp.gate_proj.weight.shape[0])
        out = {"qkv": self.linear([n for n, _ in q], shapes=[s for _, s in q]),
               "o": self.linear([f"{blk}attn_output.weight"], shapes=[(hidden, self.heads * D)]),
               "gu": self.linear([f"{blk}ffn_gate.weight", f"{blk}ffn_up.weight"], shapes=[(inter, hidden)] * 2),
               "down": self.linear([f"{blk}ffn_down.weight"], shapes=[(hidden, inter)])}
        if width := int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0):
            self.fill(dec.post_per_layer_input_norm, f"{blk}post_norm.weight")
            out["ple_gate"] = self.linear([f"{blk}inp_gate.weight"], shapes=[(width, hidden)])
            out["ple_proj"] = self.linear([f"{blk}proj.weight"], shapes=[(hidden, width)])
        if getattr(dec, "enable_moe_block", False):
            for module, tensor in _MOE_NORMS.items():
                self.fill(getattr(dec, module), f"{blk}{tensor}.weight")
            count = int(cfg.num_experts)
            self.small(dec.router, "scale", f"{blk}ffn_gate_inp.scale", hidden)
            self.small(dec.router, "per_expert_scale", f"{blk}ffn_down_exps.scale", count)
            out["experts"] = self.experts(blk)  # (its own keys: "down" is the dense MLP's)
        return out

    def model_parts(self, base: Any) -> dict[str, Any]:
        """The per-layer token table (rows looked up in place) and its projection, with its norm
        filled into ``base``; nothing for a file without per-layer embeddings."""
        width = int(getattr(self.cfg, "hidden_size_per_layer_input", 0) or 0)
        if not width:
            return {}
        layers, hidden = int(self.cfg.num_hidden_layers), int(self.cfg.hidden_size)
        self.fill(base.per_layer_projection_norm, "per_layer_proj_norm.weight")
        table = self.f.quant(self.need("per_layer_token_embd.weight"))
        if table.shape[1] != layers * width:
            raise ConfigError(f"GGUF tensor per_layer_token_embd.weight has rows of {table.shape[1]} values where "
                              f"{layers} layers of {width} need {layers * width} (the file is inconsistent)")
        proj = self.linear(["per_layer_model_proj.weight"], shapes=[(layers * width, hidden)])
        return {"ple_table": table, "ple_proj": proj}


def ple_lookup(table: Any) -> Any:
    """Token ids ``[T]`` -> their rows of the per-layer token table as float32 ``[T, layers * width]``."""
    from .native.gguf_ops import gguf_rows

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        return gguf_rows(table, ids)
    return lookup
