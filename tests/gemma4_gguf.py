"""Tiny Gemma 4 text models (``gemma4_model.SHAPES``, with the embedded SmolLM2's vocabulary and
tokenizer) saved as ``gemma4`` GGUF files the way llama.cpp's converter writes them: the
transformers names renamed one to one (norms as stored, no ``1 +``), the global layers'
proportional RoPE as ``rope_freqs.weight`` (a divisor of 1 per rotated frequency, 1e30 for the
others), the widths, head counts and sliding layers as per-layer arrays where they differ. The
tensor names, shapes and metadata keys were checked against files the converter itself wrote
from the same shapes."""

from __future__ import annotations

import numpy as np
import torch

import gemma4_model

# transformers' name within a layer -> the converter's (``blk.N.`` + this).
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight",
          "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "per_layer_input_gate.weight": "inp_gate.weight",
          "per_layer_projection.weight": "proj.weight", "post_per_layer_input_norm.weight": "post_norm.weight",
          "layer_scalar": "layer_output_scale.weight", "router.proj.weight": "ffn_gate_inp.weight",
          "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
          "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
          "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
          "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
          "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight"}
_MODEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
          "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
          "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
VOCAB = 49152  # the embedded SmolLM2's, whose tokenizer the files carry


def _file_name(name: str) -> str | None:
    if name in _MODEL:
        return _MODEL[name]
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}." + _LAYER[".".join(parts[3:])]
    return None  # (the tied head)


def _quantized(name: str, value: np.ndarray) -> bool:
    """Matrices whose rows split into 32-value blocks (others stay F32, as the converter falls back)."""
    return value.ndim >= 2 and value.shape[-1] % 32 == 0 and not name.endswith("ffn_gate_inp.weight")


def write_gemma4_gguf(path: str, name: str, qtype: str = "F32", seed: int = 0,
                      drop: tuple[str, ...] = ()) -> torch.nn.Module:
    """Write the tiny model ``name`` to ``path`` (matrices in ``qtype``: F32 or Q8_0; ``drop``:
    tensors left out, to make a broken file); returns transformers' model (float32, eval mode)
    holding the weights the file decodes to."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from gguf_writer import _write_tokenizer
    from hybrid_model import _write_tensors
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = dict(gemma4_model.SHAPES[name], vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if extra.get("hidden_size_per_layer_input"):
        extra["vocab_size_per_layer_input"] = VOCAB
    cfg = AutoConfig.for_model("gemma4_text", **{**gemma4_model.TEXT, **extra})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gemma4_model._stir(model, seed)
    model.generation_config.eos_token_id = None
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {file: value for key, value in state.items() if (file := _file_name(key)) is not None}
    if qtype != "F32":  # the reference holds what the file decodes to
        t = GGMLQuantizationType[qtype]
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for key, value in state.items():
            file = _file_name(key)
            if file is not None and _quantized(file, value):
                rounded = dequantize(quantize(value.astype(np.float32), t), t).reshape(value.shape)
                tensors[file] = rounded
                with torch.no_grad():
                    params[key].copy_(torch.from_numpy(np.ascontiguousarray(rounded)))
    layers, kinds = cfg.num_hidden_layers, cfg.layer_types
    shapes = [(c.num_key_value_heads, c.head_dim) for c in cfg.per_layer_config]
    global_dim, swa_dim = max(d for _, d in shapes), min(d for _, d in shapes)
    rotated = int(global_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"]) // 2
    tensors["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (global_dim // 2 - rotated), np.float32)
    w = gguf.GGUFWriter(path, "gemma4")
    shared = cfg.num_kv_shared_layers
    ffn = [cfg.intermediate_size * (2 if cfg.use_double_wide_mlp and i >= layers - shared else 1)
           for i in range(layers)]
    kv = [h for h, _ in shapes]
    for key, value in {"block_count": layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "attention.head_count": cfg.num_attention_heads,
                       "attention.key_length": global_dim, "attention.value_length": global_dim,
                       "attention.key_length_swa": swa_dim, "attention.value_length_swa": swa_dim,
                       "attention.sliding_window": cfg.sliding_window, "attention.shared_kv_layers": shared,
                       "embedding_length_per_layer_input": cfg.hidden_size_per_layer_input or 0,
                       "rope.dimension_count": global_dim, "rope.dimension_count_swa": swa_dim}.items():
        w.add_uint32(f"gemma4.{key}", int(value))
    w.add_array("gemma4.feed_forward_length", ffn) if len(set(ffn)) > 1 else w.add_uint32(
        "gemma4.feed_forward_length", ffn[0])
    w.add_array("gemma4.attention.head_count_kv", kv) if len(set(kv)) > 1 else w.add_uint32(
        "gemma4.attention.head_count_kv", kv[0])
    w.add_array("gemma4.attention.sliding_window_pattern", [k == "sliding_attention" for k in kinds])
    if cfg.enable_moe_block:
        w.add_uint32("gemma4.expert_count", cfg.num_experts)
        w.add_uint32("gemma4.expert_used_count", cfg.top_k_experts)
        w.add_uint32("gemma4.expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_float32("gemma4.rope.freq_base", float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    w.add_float32("gemma4.rope.freq_base_swa", float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
    w.add_float32("gemma4.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    w.add_float32("gemma4.final_logit_softcapping", float(cfg.final_logit_softcapping))
    _write_tokenizer(w)
    _write_tensors(w, {file: None if file in drop else value for file, value in tensors.items()}, qtype, seed,
                   _quantized)
    return model
