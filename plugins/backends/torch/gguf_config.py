"""What transformers' GGUF mapping leaves out of a model's config, read from the file's header as
llama.cpp reads it: head sizes, expert sizes, Gemma 3's query scale and local RoPE, gpt-oss's
window and YaRN, and Llama 3.1's RoPE scaling stored as a tensor (``rope_freqs.weight``).

``f`` below is ``gguf_model._File``: its ``architecture``, ``fields`` (metadata by key) and
``vector(name)`` (a 1-D tensor as fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve import ConfigError


def rope_factors(model: Any, f: Any) -> None:
    """Llama 3.1+ files carry their RoPE scaling as ``rope_freqs.weight``, one divisor per
    frequency (llama.cpp's converter computes them from the config's llama3 factors), and no
    metadata key transformers' mapping would read: the rotary embedding's frequencies are divided
    by them here, which is the llama3 rule (``inv_freq / factor`` where the wavelength is long,
    untouched where short, interpolated between)."""
    if "rope_freqs.weight" not in f:
        return
    factors = f.vector("rope_freqs.weight")
    rotary = model.get_decoder().rotary_emb
    if factors.numel() != rotary.inv_freq.numel() or not bool((factors > 0).all()):
        raise ConfigError(f"GGUF tensor rope_freqs.weight has {factors.numel()} values where the rotary embedding "
                          f"has {rotary.inv_freq.numel()} frequencies (or a divisor is not positive)")
    done: set[int] = set()
    for name in ("inv_freq", "original_inv_freq"):  # often one tensor under two names: divided once
        t = getattr(rotary, name, None)
        if isinstance(t, torch.Tensor) and t.data_ptr() not in done:
            done.add(t.data_ptr())
            t.div_(factors.to(t.dtype))


def config_from_header(config: Any, f: Any) -> None:
    """What transformers' GGUF mapping leaves out of ``config``, read from the file's header as
    llama.cpp reads it: the head size (``attention.key_length``: Qwen3's is 128 whatever the
    hidden size, and the mapping leaves it at its config class's default) and Gemma 3's query
    scale, local RoPE base, RoPE scaling, logit softcapping and sliding-window pattern."""
    arch, fields = f.architecture, f.fields
    key, value = (fields.get(f"{arch}.attention.{n}_length") for n in ("key", "value"))
    if key is not None and value is not None and int(value) != int(key):
        raise ConfigError(f"GGUF file has keys of {key} and values of {value} values a head; the paged KV cache "
                          "holds heads of one size")
    if key is not None:
        config.head_dim = int(key)
    if arch == "llama" and fields.get("llama.expert_count"):
        raise ConfigError(f"GGUF file is a Mixtral-style llama with {fields['llama.expert_count']} experts, which "
                          "this loader does not read; serve the model's safetensors (Mixtral runs on the fused "
                          "forward from them)")
    if arch == "qwen3moe":  # read as llama.cpp reads a qwen3moe file: every layer sparse, weights renormalised
        if (size := fields.get("qwen3moe.expert_feed_forward_length")) is not None:
            config.moe_intermediate_size = int(size)
        config.norm_topk_prob, config.mlp_only_layers, config.decoder_sparse_step = True, [], 1
    if arch == "gpt-oss":
        _gpt_oss_config(config, fields)
    if arch != "gemma3":
        return
    layers = int(config.num_hidden_layers)
    # The file carries no query scale: llama.cpp scales the 62-layer (27B) model by hidden / heads
    # and every other one by the head size.
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if layers == 62
                                    else config.head_dim)
    rope = config.rope_parameters
    if (local := fields.get("gemma3.rope.freq_base_swa")) is not None:
        rope["sliding_attention"]["rope_theta"] = float(local)
    factor = fields.get("gemma3.rope.scaling.factor")
    if fields.get("gemma3.rope.scaling.type") == "linear" and factor and float(factor) != 1.0:
        rope["full_attention"].update(rope_type="linear", factor=float(factor))  # global layers only
    cap = fields.get("gemma3.final_logit_softcapping")
    config.final_logit_softcapping = float(cap) if cap else None
    if "gemma3.attention.sliding_window_pattern" in fields:
        period = fields["gemma3.attention.sliding_window_pattern"]
        if not isinstance(period, int) or period < 1:
            raise ConfigError("GGUF file gives its own per-layer sliding-window pattern, which this loader does not "
                              "read; serve it with --no-torch-gguf-native")
        config.layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    if not fields.get("gemma3.attention.sliding_window"):  # no window: every layer global, as llama.cpp runs it
        config.layer_types = ["full_attention"] * layers


def _gpt_oss_config(config: Any, fields: dict[str, Any]) -> None:
    """A gpt-oss file read as llama.cpp reads it: the experts' size, the window of its
    alternate (even) sliding layers and its YaRN scaling (transformers' mapping leaves the
    window and the beta values at defaults), unrounded as the model's own config has it."""
    if (size := fields.get("gpt-oss.expert_feed_forward_length")) is not None:
        config.intermediate_size = int(size)
    window = fields.get("gpt-oss.attention.sliding_window")
    layers = int(config.num_hidden_layers)
    if window:
        config.sliding_window = int(window)
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:
        config.layer_types = ["full_attention"] * layers
    base = float(fields.get("gpt-oss.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    if fields.get("gpt-oss.rope.scaling.type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": base, "factor": float(fields["gpt-oss.rope.scaling.factor"]),
                "original_max_position_embeddings": int(fields["gpt-oss.rope.scaling.original_context_length"]),
                "beta_fast": float(fields.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(fields.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
        if (factor := fields.get("gpt-oss.rope.scaling.yarn_attn_factor")) is not None:
            rope["attention_factor"] = float(factor)
    elif fields.get("gpt-oss.rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"GGUF file scales RoPE by {fields['gpt-oss.rope.scaling.type']!r}, which this loader "
                          "does not read for gpt-oss")
    config.rope_parameters = rope
