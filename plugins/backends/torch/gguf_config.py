"""What transformers' GGUF mapping leaves out of a model's config, read from the file's header as
llama.cpp reads it: head sizes, expert sizes, Gemma 3's query scale and local RoPE, gpt-oss's
window and YaRN, and Llama 3.1's RoPE scaling stored as a tensor (``rope_freqs.weight``); and the
whole config of the architectures it does not know (the hybrids, LFM2, the Qwen-VL language models).

``f`` below is ``gguf_model._File``: its ``architecture``, ``fields`` (metadata by key) and
``vector(name)`` (a 1-D tensor as fp32).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmserve import ConfigError


def rope_factors(model: Any, f: Any) -> None:
    """Llama 3.1+ files carry their RoPE scaling as ``rope_freqs.weight``, one divisor per
    frequency (llama.cpp's converter computes them from the config's llama3 factors), and no
    metadata key transformers' mapping would read: the rotary embedding's frequencies are divided
    by them here, which is the llama3 rule (``inv_freq / factor`` where the wavelength is long,
    untouched where short, interpolated between)."""
    if "rope_freqs.weight" not in f or f.architecture == "gemma4":  # (Gemma 4's: its proportional RoPE)
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
    if arch == "gemma4":  # (gemma4_config reads it whole: two head sizes, its own RoPE)
        return
    key, value = (v if isinstance(v := fields.get(f"{arch}.attention.{n}_length"), int) else None
                  for n in ("key", "value"))  # a per-layer list is not a head size
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


def _need(header: Any) -> Callable[[str], Any]:
    """``need(key)``: the header's ``{architecture}.{key}``, or a ConfigError naming the key missing."""
    f, arch = header.fields, header.architecture

    def need(key: str) -> Any:
        if f.get(f"{arch}.{key}") is None:
            raise ConfigError(f"GGUF file lacks {arch}.{key}; it is not a complete {arch} model")
        return f[f"{arch}.{key}"]

    return need


def hybrid_config(header: Any) -> Any:
    """The config of a ``qwen35``, ``qwen35moe`` or ``qwen3next`` file (Qwen3.5's text model,
    dense or MoE, and Qwen3-Next), which transformers' GGUF reading does not know, from its
    header as llama.cpp reads it: which layers are Gated DeltaNet ones (those with ``ssm_a``),
    their head counts and sizes (``ssm.group_count`` key heads and ``ssm.time_step_rank`` value
    heads of ``ssm.state_size`` and ``ssm.inner_size / value heads``), the convolution's width, the
    partial RoPE (``rope.dimension_count`` of each head) and, for the MoE models, the experts'
    count, size and top k and the shared expert's size (a Qwen3-Next layer without a router is a
    dense one)."""
    from transformers import AutoConfig

    f, t, arch = header.fields, header.tensors, header.architecture
    need = _need(header)

    layers, head_dim = int(need("block_count")), int(need("attention.key_length"))
    kinds = ["linear_attention" if f"blk.{i}.ssm_a" in t else "full_attention" for i in range(layers)]
    missing = [i for i, kind in enumerate(kinds) if kind == "full_attention" and f"blk.{i}.attn_q.weight" not in t]
    if missing:
        raise ConfigError(f"GGUF file's layer {missing[0]} has neither a Gated DeltaNet state (ssm_a) nor attention "
                          f"(attn_q): it is not a complete {arch} model")
    value_heads = int(need("ssm.time_step_rank"))
    mlp: dict[str, Any] = {}
    if arch in ("qwen35moe", "qwen3next"):
        mlp = dict(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(need("expert_shared_feed_forward_length")))
    if arch == "qwen3next":
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in t]
        mlp.update(decoder_sparse_step=1, mlp_only_layers=dense, norm_topk_prob=True)
    if arch == "qwen35" or (arch == "qwen3next" and mlp["mlp_only_layers"]):
        mlp["intermediate_size"] = int(need("feed_forward_length"))
    model_type = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}[arch]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(need("rope.freq_base")),
                            "partial_rotary_factor": int(need("rope.dimension_count")) / head_dim}
    sections = [int(n) for n in f.get(f"{arch}.rope.dimension_sections") or ()]
    if sections:  # Qwen3.5's rotary reads three position axes, interleaved (its images: gguf_vision.py)
        rope |= {"mrope_section": sections[:3], "mrope_interleaved": True}
    config = AutoConfig.for_model(
        model_type, vocab_size=int(t["token_embd.weight"].shape[-1]), hidden_size=int(need("embedding_length")),
        num_hidden_layers=layers, num_attention_heads=int(need("attention.head_count")),
        num_key_value_heads=int(need("attention.head_count_kv")),
        head_dim=head_dim, rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")), layer_types=kinds,
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")), linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in t,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"), **mlp)
    config.architectures = [{"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                             "qwen3next": "Qwen3NextForCausalLM"}[arch]]
    if sections:
        config.mrope_section = sections[:3]
    return config


def lfm2_config(header: Any) -> Any:
    """The config of an ``lfm2`` file from its header as llama.cpp reads it: the attention layers
    are those with key and value heads (``attention.head_count_kv`` lists them per layer), the
    convolution's width is ``shortconv.l_cache``, the feed-forward width is the final one, biases
    where the file has ``shortconv.in_proj.bias``."""
    from transformers import AutoConfig

    f, t = header.fields, header.tensors
    need = _need(header)

    layers = int(need("block_count"))
    kv = need("attention.head_count_kv")
    kv = tuple(kv) if isinstance(kv, tuple) else (int(kv),) * layers
    if len(kv) != layers or not any(kv):
        raise ConfigError(f"GGUF file's lfm2.attention.head_count_kv gives {len(kv)} layers' key and value heads for "
                          f"{layers} layers (or no attention layer): it is not a complete lfm2 model")
    config = AutoConfig.for_model(
        "lfm2", vocab_size=int(t["token_embd.weight"].shape[-1]), hidden_size=int(need("embedding_length")),
        num_hidden_layers=layers, intermediate_size=int(need("feed_forward_length")), block_auto_adjust_ff_dim=False,
        num_attention_heads=int(need("attention.head_count")), num_key_value_heads=max(kv),
        layer_types=["full_attention" if n else "conv" for n in kv], conv_L_cache=int(need("shortconv.l_cache")),
        conv_bias="blk.0.shortconv.in_proj.bias" in t, norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(need("rope.freq_base"))},
        tie_word_embeddings="output.weight" not in t,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"))
    config.architectures = ["Lfm2ForCausalLM"]
    return config


def mrope_axes(sections: list[int], interleaved: bool) -> list[int]:
    """Each rotary frequency's position axis (0 time, 1 rows, 2 columns) for a GGUF file's
    ``rope.dimension_sections``: contiguous runs of that many (llama.cpp's M-RoPE, Qwen2-VL), or
    interleaved (its I-M-RoPE, Qwen3-VL and Qwen3.5: frequency i reads rows when i % 3 == 1 and
    columns when i % 3 == 2, within three times those axes' sections; time otherwise)."""
    t, h, w = sections[:3]
    if not interleaved:
        return [0] * t + [1] * h + [2] * w
    return [1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0 for i in range(t + h + w)]


def qwen_vl_config(header: Any) -> Any:
    """The config of a ``qwen2vl`` or ``qwen3vl`` file (the language model of Qwen2-VL / Qwen2.5-VL,
    a Qwen2 decoder, or of Qwen3-VL, a Qwen3 one, as llama.cpp's converter writes them; transformers'
    GGUF reading knows neither), whose rotary frequencies read three position axes,
    ``rope.dimension_sections`` of them each: ``mrope_axes`` names each frequency's axis for the
    fused forward (``mrope.frequency_axes``), ``mrope_section`` keeps the sections. Text alone reads
    the same position on every axis: plain RoPE."""
    from transformers import Qwen2Config, Qwen3Config

    f, t, arch = header.fields, header.tensors, header.architecture
    need = _need(header)

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    head_dim = int(f.get(f"{arch}.attention.key_length") or hidden // heads)
    sections = [int(n) for n in need("rope.dimension_sections")]
    if sum(sections) * 2 != head_dim or any(sections[3:]):
        raise ConfigError(f"GGUF file's {arch}.rope.dimension_sections {sections} do not split the {head_dim // 2} "
                          "rotary frequencies of a head into time, rows and columns")
    qwen3 = arch == "qwen3vl"
    config = (Qwen3Config if qwen3 else Qwen2Config)(
        vocab_size=int(t["token_embd.weight"].shape[-1]), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(need("attention.head_count_kv")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(need("rope.freq_base"))},
        tie_word_embeddings="output.weight" not in t, **({"head_dim": head_dim} if qwen3 else {}),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"))
    config.mrope_section = sections[:3]
    config.mrope_axes = mrope_axes(sections, interleaved=qwen3)
    config.architectures = ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"]
    return config


def _per_layer(value: Any, layers: int, key: str) -> list[int]:
    """A field given once for every layer or as one value per layer (llama.cpp's arrays)."""
    values = [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * layers
    if len(values) != layers:
        raise ConfigError(f"GGUF file's {key} gives {len(values)} values for {layers} layers (the file is "
                          "inconsistent)")
    return values


def gemma4_config(header: Any) -> Any:
    """The config of a ``gemma4`` file (Gemma 4's text model) from its header as llama.cpp's
    converter writes it: sliding layers by ``attention.sliding_window_pattern``, their head size
    ``key_length_swa`` and the global layers' ``key_length``; key and value heads once or per layer
    (the global layers' own count where their keys are their values: no ``attn_v`` in them); the
    feed-forward width per layer (the reading layers' doubled); the layers reading earlier ones'
    keys (``attention.shared_kv_layers``); per-layer embeddings; experts beside the MLP; and the
    global layers' proportional RoPE, whose rotated share ``rope_freqs.weight`` gives (a divisor
    of 1 per rotated frequency, 1e30 for the rest)."""
    import numpy as np
    from transformers import Gemma4TextConfig

    f, t = header.fields, header.tensors
    need = _need(header)
    layers = int(need("block_count"))
    pattern = need("attention.sliding_window_pattern")
    if not isinstance(pattern, (tuple, list)) or len(pattern) != layers:
        raise ConfigError("GGUF file's gemma4.attention.sliding_window_pattern does not list every layer: it is not a "
                          "complete gemma4 model")
    kinds = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    kv = _per_layer(need("attention.head_count_kv"), layers, "gemma4.attention.head_count_kv")
    ffn = _per_layer(need("feed_forward_length"), layers, "gemma4.feed_forward_length")
    shared = int(f.get("gemma4.attention.shared_kv_layers") or 0)
    own = [i for i in range(layers - shared) if kinds[i] == "full_attention"]
    keys_are_values = bool(own) and all(f"blk.{i}.attn_v.weight" not in t for i in own)
    swa_kv = {kv[i] for i in range(layers) if kinds[i] == "sliding_attention"}
    full_kv = {kv[i] for i in range(layers) if kinds[i] == "full_attention"}
    if len(swa_kv) > 1 or len(full_kv) > 1 or (full_kv != swa_kv and not keys_are_values):
        raise ConfigError(f"GGUF file's key and value heads per layer {kv} are not one count for the sliding layers "
                          "and one for the global ones (where their keys are their values): not a gemma4 layout")
    head_dim, global_dim = int(need("attention.key_length_swa")), int(need("attention.key_length"))
    partial = 1.0
    if "rope_freqs.weight" in t:
        freqs = t["rope_freqs.weight"]
        raw = np.asarray(freqs.data)
        divisors = (raw.view(np.float32) if raw.dtype == np.uint8 else raw.astype(np.float32)).reshape(-1)
        rotated = int((divisors == 1.0).sum())
        if divisors.size != global_dim // 2 or not bool((divisors[:rotated] == 1.0).all()):
            raise ConfigError("GGUF tensor rope_freqs.weight is not the global layers' proportional RoPE (a divisor "
                              f"of 1 for each rotated frequency, then none): {divisors.size} values for heads of "
                              f"{global_dim}")
        partial = 2 * rotated / global_dim
    experts = int(f.get("gemma4.expert_count") or 0)
    moe = dict(enable_moe_block=True, num_experts=experts, top_k_experts=int(need("expert_used_count")),
               moe_intermediate_size=int(need("expert_feed_forward_length"))) if experts else {}
    ple = int(f.get("gemma4.embedding_length_per_layer_input") or 0)
    for name in ("token_embd.weight", *(("per_layer_token_embd.weight",) if ple else ())):
        if name not in t:
            raise ConfigError(f"GGUF file lacks tensor {name}; it is not a complete gemma4 model")
    window = f.get("gemma4.attention.sliding_window")
    config = Gemma4TextConfig(
        vocab_size=int(t["token_embd.weight"].shape[-1]), hidden_size=int(need("embedding_length")),
        intermediate_size=ffn[0], use_double_wide_mlp=ffn[-1] == 2 * ffn[0] and shared > 0,
        num_hidden_layers=layers, num_attention_heads=int(need("attention.head_count")),
        num_key_value_heads=min(swa_kv or full_kv), head_dim=head_dim, global_head_dim=global_dim,
        num_global_key_value_heads=min(full_kv) if keys_are_values else None, attention_k_eq_v=keys_are_values,
        num_kv_shared_layers=shared, layer_types=kinds, sliding_window=int(window) if window else 512,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        final_logit_softcapping=float(f["gemma4.final_logit_softcapping"]) if f.get(
            "gemma4.final_logit_softcapping") else None,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(t["per_layer_token_embd.weight"].shape[-1]) if ple else 262144,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": float(need("rope.freq_base_swa"))},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                                            "rope_theta": float(need("rope.freq_base"))}},
        tie_word_embeddings="output.weight" not in t,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"), **moe)
    want = [ffn[0] * (2 if config.use_double_wide_mlp and i >= layers - shared else 1) for i in range(layers)]
    if ffn != want:
        raise ConfigError(f"GGUF file's feed-forward widths {ffn} are neither one width nor doubled in the layers that "
                          "read earlier layers' keys: not a gemma4 layout")
    config.architectures = ["Gemma4ForCausalLM"]
    return config


# GGUF architectures whose config llmserve writes from the header itself: architecture -> (the
# architecture its tokenizer converts under, where transformers does not know the file's own, or
# None; the config maker).
OWN_CONFIGS: dict[str, tuple[str | None, Callable[[Any], Any]]] = {
    **{arch: ("qwen3", hybrid_config) for arch in ("qwen35", "qwen35moe", "qwen3next")}, "lfm2": (None, lfm2_config),
    "qwen2vl": ("qwen2", qwen_vl_config), "qwen3vl": ("qwen3", qwen_vl_config), "gemma4": ("gemma3", gemma4_config)}
# GGUF architectures whose weights transformers' GGUF conversion cannot read.
UNCONVERTIBLE = {"gpt-oss", "qwen35", "qwen35moe", "qwen3next", "gemma4"}
