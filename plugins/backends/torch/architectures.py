"""Which model architectures the torch backend serves, and why it refuses the others: the ones
tests/backends/test_architecture_conformance.py verifies against transformers' ``generate``, and
the families whose layers keep state outside the paged KV cache (they would answer wrong)."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from llmserve import ConfigError

FLAG = "--allow-unverified-architecture"

# The backend's own forward (fused.py) runs these when it recognises the layers exactly (a test
# holds this to fused.py's own set); their transformers forward is verified as well.
FUSED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma3_text", "gpt_oss",
         "gemma4_text")

# model_type -> what its tiny model in the conformance test exercises beyond a plain decoder.
# Each one's greedy continuations equal transformers' generate alone, four requests at once, past
# every sliding window and from the prefix cache; the test's own list is held to these keys.
VERIFIED: dict[str, str] = {
    "llama": "",
    "mistral": "sliding window",
    "qwen2": "biased QKV, one sliding-window layer",
    "mixtral": "mixture of experts, sliding window",
    "qwen2_moe": "mixture of experts with a shared expert",
    "qwen3": "q/k norms, one sliding-window layer",
    "qwen3_moe": "mixture of experts, q/k norms",
    "gemma": "scaled embeddings, GeLU",
    "gemma2": "sliding-window layers, final logit softcapping (attention softcapping is refused)",
    "gemma3_text": "sliding-window layers, local and global RoPE",
    "gemma4_text": "global layers of fewer, wider heads than the sliding ones (keys as values), layers reading an "
                   "earlier layer's keys and values, per-layer embeddings, proportional RoPE",
    "phi3": "fused QKV and gate-up projections",
    "olmo2": "post-norms, q/k norms",
    "olmo": "non-parametric layer norm",
    "olmoe": "mixture of experts",
    "olmo3": "sliding-window layers",
    "granite": "embedding, residual, attention and logit multipliers",
    "granitemoe": "mixture of experts, multipliers",
    "granitemoeshared": "mixture of experts with a shared MLP",
    "cohere": "parallel attention and MLP, logit scale",
    "cohere2": "sliding-window layers, logit scale",
    "starcoder2": "sliding window, LayerNorm, biases",
    "stablelm": "partial rotary",
    "gpt_neox": "partial rotary, parallel residual",
    "gpt2": "learned positions, Conv1D projections",
    "opt": "learned positions with an offset",
    "phi": "partial rotary, parallel attention and MLP",
    "smollm3": "layers without RoPE",
    "glm": "partial interleaved rotary",
    "glm4": "extra post-norms",
    "helium": "",
    "exaone4": "sliding-window layers",
    "ernie4_5": "",
    "seed_oss": "biased QKV",
    "ministral": "sliding window on every layer",
    "internlm3": "",
    "nemotron": "squared-ReLU MLP, LayerNorm1P",
    "hunyuan_v1_dense": "q/k norms",
    "arcee": "squared-ReLU MLP",
    "apertus": "xIELU MLP, q/k norms",
    "gpt_oss": "attention sinks, mixture of experts with biases and a clamped SwiGLU, alternating sliding windows, "
               "YaRN",
}

# Vision-language models whose image path (vision.py) tests/backends/test_vision_models.py verifies
# against transformers' forward with images; their language model must be a verified one too.
VISION: dict[str, str] = {
    "idefics3": "SmolVLM-256M/500M and Idefics3: image tiles with row markers and a global image, a pixel-shuffle "
                "projector, a Llama language model",
    "qwen2_vl": "Qwen2-VL: a vision tower of full attention, patches merged 2x2, positions along three axes; a "
                "Qwen2 language model",
    "qwen2_5_vl": "Qwen2.5-VL: a windowed-attention vision tower, patches merged 2x2, positions along three axes "
                  "(time, rows, columns) for the image tokens and after them; a Qwen2 language model",
    "qwen3_vl": "Qwen3-VL: as Qwen2.5-VL with the rotary frequencies' axes interleaved, and the vision tower's inner "
                "features added to the image tokens' hidden states after the first layers; a Qwen3 language model",
    "qwen3_5": "Qwen3.5's images: Qwen3-VL's vision tower without its inner features, positions along three axes "
               "for the gated attention layers; the hybrid language model below",
    "qwen3_5_moe": "Qwen3.5-MoE's images: as Qwen3.5's",
    "gemma3": "Gemma 3 (4B, 12B, 27B): a SigLIP vision tower, patches average-pooled to 256 image tokens that "
              "attend to each other both ways (each image fed in one step); a Gemma 3 language model",
}

# Multimodal checkpoints whose language model alone is served (loaded without the other towers'
# weights; a request with an image is refused): model_type -> what is left out.
LANGUAGE_ONLY: dict[str, str] = {
    "gemma4": "Gemma 4's checkpoints (E2B, E4B, 26B-A4B, 31B): the language model above; its vision and audio "
              "towers are not loaded, so images and audio are refused",
}

# Hybrid families served with a recurrent state per sequence beside the paged KV cache
# (recurrent.py), each verified by tests/backends/test_hybrid_models.py against transformers:
# model_type -> what its layers are. A multimodal checkpoint (Qwen3.5's) reads images too (VISION).
HYBRID: dict[str, str] = {
    **dict.fromkeys(("qwen3_5", "qwen3_5_text"),
                    "Gated DeltaNet layers (a recurrent state per sequence) with gated full attention, partial RoPE"),
    **dict.fromkeys(("qwen3_5_moe", "qwen3_5_moe_text"),
                    "Gated DeltaNet layers with gated full attention, mixture of experts with a shared expert"),
    "qwen3_next": "Gated DeltaNet layers with gated full attention, mixture of experts with a shared expert",
    "lfm2": "short-convolution layers (a convolution window per sequence) with full attention and q/k norms",
    "granitemoehybrid": "Mamba2 layers (a convolution window and a selective state per sequence) with attention, "
                        "mixture of experts beside a shared MLP, Granite's multipliers",
    "lfm2_moe": "short-convolution layers with full attention, dense then mixture-of-experts feed-forwards "
                "(a sigmoid router with a per-expert bias)",
    "bamba": "Mamba2 layers with attention, a gated MLP after each",
    "nemotron_h": "Mamba2, attention, squared-ReLU MLP and mixture-of-experts blocks, each a layer of its own",
}

# Hybrid families served on transformers' forward with their recurrent layers replaced (the rest
# run the fused hybrid forward, fused_hybrid.py).
UNFUSED_HYBRID = frozenset({"granitemoehybrid", "bamba", "nemotron_h", "lfm2_moe"})

# The families whose layers keep a state beside (or instead of) keys and values that the backend
# does not hold yet: prefix caching and batching would mix it up, and the answers come out wrong.
# model_type -> the layers and the state they keep.
STATEFUL: dict[str, str] = {
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text", "kimi_linear", "olmo_hybrid", "bailing_hybrid", "lara_mini"),
                    "linear-attention layers keep a recurrent state"),
    **dict.fromkeys(("jamba", "falcon_h1", "zamba", "zamba2", "mamba",
                     "mamba2", "falcon_mamba"),
                    "Mamba layers keep a convolution and an SSM state"),
    "lfm3": "short-convolution layers keep a convolution state",
    **dict.fromkeys(("zaya", "inkling_text", "inkling2_text", "inkling2_loop_text"),
                    "hybrid layers keep a linear-attention state"),
    "minimax": "lightning (linear) attention layers keep a recurrent state",
    "recurrent_gemma": "RG-LRU layers keep a recurrent state",
    "rwkv": "RWKV time-mixing layers keep a recurrent state",
    "xlstm": "xLSTM cells keep a recurrent state",
}

# Stateless architectures the backend cannot run right either, refused whatever the flag says.
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "longcat_flash", "sarvam_mla"),
                    "multi-head latent attention (keys and values of different head sizes), which the paged KV "
                    "cache does not hold"),
    **dict.fromkeys(("llama4", "llama4_text"), "chunked attention layers, which the paged attention does not mask"),
    "phimoe": "its attention does not pass its sliding window to the attention function, so the paged attention "
              "would attend past it",
}

# Layer kinds (config ``layer_types`` and its older spellings) by what the paged KV cache makes of them.
ATTENTION_KINDS = frozenset({"full_attention", "attention", "sliding_attention"})
NO_STATE_KINDS = frozenset({"mlp", "moe", "dense", "sparse"})  # feed-forward only: nothing to keep
STATE_KINDS: dict[str, str] = {
    "linear_attention": "a recurrent state", "mamba": "a convolution and an SSM state",
    "conv": "a convolution state", "recurrent": "a recurrent state",
    "hybrid": "a linear-attention state", "hybrid_sliding": "a linear-attention state",
}
UNSUPPORTED_KINDS = frozenset({"chunked_attention", "indexed_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention", "minimax_m3_sparse", "window_attention",
                               "reference_sliding_attention", "deepseek_sparse_attention", "qwen_sparse_attention"})
_KIND_KEYS = ("layer_types", "layers_block_type", "block_types")


def _sections(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The config and the text model's config inside it (multimodal wrappers)."""
    text = raw.get("text_config")
    return [raw, text] if isinstance(text, dict) else [raw]


def layer_kind_refusal(kinds: Iterable[Any]) -> str | None:
    """Why layers of these ``kinds`` cannot be served (None when the paged KV cache holds them all)."""
    for kind in dict.fromkeys(kinds):
        if kind in ATTENTION_KINDS or kind in NO_STATE_KINDS:
            continue
        if kind in STATE_KINDS:
            return (f"its {kind} layers keep {STATE_KINDS[kind]} outside the KV cache, which the torch backend's "
                    "paged KV cache cannot hold (it would answer with wrong tokens)")
        if kind in UNSUPPORTED_KINDS:
            return f"its {kind} layers need an attention the torch backend's paged attention does not run"
        return (f"its layer_types name a layer kind {kind!r} llmserve does not know (known: "
                f"{', '.join(sorted(ATTENTION_KINDS | NO_STATE_KINDS | set(STATE_KINDS) | UNSUPPORTED_KINDS))})")
    return None


def _refuse(source: str, arch: str, why: str) -> ConfigError:
    return ConfigError(f"model {source!r} is a {arch!r} model, which the torch backend refuses: {why}")


def check_config_file(model_dir: str, source: str) -> None:
    """Refuse, before any weight is read, a directory whose ``config.json`` names a stateful
    family or a layer kind the paged KV cache cannot hold (or does not know)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return  # transformers' own loading reports a missing or broken config
    if not isinstance(raw, dict):
        return
    for section in _sections(raw):
        arch = str(section.get("model_type") or raw.get("model_type") or "?")
        if arch in HYBRID:
            continue
        if arch in STATEFUL:
            raise _refuse(source, arch, f"its {STATEFUL[arch]} outside the KV cache, which the torch backend's paged "
                                        "KV cache cannot hold (it would answer with wrong tokens)")
        for key in _KIND_KEYS:
            kinds = section.get(key)
            if isinstance(kinds, list) and (why := layer_kind_refusal(kinds)):
                raise _refuse(source, arch, why)


def _cache_layer_kinds(text_cfg: Any) -> list[str]:
    """The cache layer kinds transformers itself would build for this config (empty where this
    transformers has no per-layer cache description)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        return []
    try:
        kinds, _ = get_layer_types_and_kwargs(text_cfg)
    except Exception:  # noqa: BLE001 - a config it cannot describe: the other checks decide
        return []
    return [k for k in kinds if k != "dummy"]  # dummy: a layer that reuses another's keys and values


def check_config(config: Any, source: str, allow_unverified: bool) -> str | None:
    """Refuse what the loaded transformers ``config`` says the backend cannot serve right; returns
    the architecture when it is served unverified (``allow_unverified``), else None."""
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    archs = list(dict.fromkeys(str(getattr(c, "model_type", "") or "?") for c in (config, text_cfg)))
    for arch in archs:
        if arch in STATEFUL:
            raise _refuse(source, arch, f"its {STATEFUL[arch]} outside the KV cache, which the torch backend's paged "
                                        "KV cache cannot hold (it would answer with wrong tokens)")
        if arch in UNSUPPORTED:
            raise _refuse(source, arch, UNSUPPORTED[arch])
    arch = archs[0]
    if all(a in HYBRID for a in archs):
        return None
    kinds = [*(getattr(text_cfg, "layer_types", None) or []), *_cache_layer_kinds(text_cfg)]
    if why := layer_kind_refusal(kinds):
        raise _refuse(source, arch, why)
    if getattr(text_cfg, "v_head_dim", None) is not None or getattr(text_cfg, "kv_lora_rank", None):
        raise _refuse(source, arch, UNSUPPORTED["deepseek_v3"])
    # A vision model's language model: a verified family, or its own (Qwen-VL's ``qwen2_5_vl_text``),
    # which the vision test verifies with it.
    if arch in VERIFIED or (arch in VISION and archs[-1] in (*VERIFIED, f"{arch}_text")) or (
            arch in LANGUAGE_ONLY and archs[-1] in VERIFIED):
        return None
    if not allow_unverified:
        raise ConfigError(f"model {source!r} is a {arch!r} model, an architecture the torch backend has not verified "
                          "against transformers (the verified ones are listed in docs/engine.md#architectures): "
                          f"serve it anyway with {FLAG} (its answers may be wrong), or serve a verified architecture")
    return arch


def check_modules(model: Any, source: str, arch: str) -> None:
    """Refuse a loaded model with a causal convolution (``nn.Conv1d``, the rolling state of Mamba,
    Gated DeltaNet and short-convolution layers): a last guard for architectures served unverified,
    whose config does not say what their layers keep."""
    import torch

    if arch in HYBRID:  # their convolutions' windows live in the state slots (recurrent.py)
        return
    conv = next((name for name, m in model.named_modules() if isinstance(m, torch.nn.Conv1d)), None)
    if conv is not None:
        raise _refuse(source, arch, f"its layer {conv} is a convolution over the sequence, whose state lives "
                                    "outside the KV cache (the paged KV cache cannot hold it)")


def markdown_table() -> str:
    """The table of docs/engine.md#architectures (a test holds the page to it)."""
    rows = ["| architecture (`model_type`) | served | what the conformance test covers, or why it is refused |",
            "|---|---|---|"]
    for arch, note in sorted(VERIFIED.items()):
        how = "fused forward; transformers' forward verified too" if arch in FUSED else "transformers' forward"
        rows.append(f"| `{arch}` | {how} | {note or 'a plain decoder'} |")
    for arch, note in sorted(VISION.items()):
        rows.append(f"| `{arch}` | images and text; its language model as above | {note} |")
    for arch, note in sorted(LANGUAGE_ONLY.items()):
        rows.append(f"| `{arch}` | text only; its language model as above | {note} |")
    for arch, note in sorted(HYBRID.items()):
        forward = "transformers' forward" if arch in UNFUSED_HYBRID else "fused forward"
        rows.append(f"| `{arch}` | {forward}; its recurrent layers on the state slots | {note} |")
    refused = {**{a: f"{why} outside the KV cache" for a, why in STATEFUL.items()}, **UNSUPPORTED}
    for arch, why in sorted(refused.items()):
        rows.append(f"| `{arch}` | refused | {why} |")
    return "\n".join(rows) + "\n"
