"""Tiny Qwen-VL checkpoints (``tests/vision_model.py``) written as llama.cpp's converter writes a
GGUF vision model, F32 throughout: the language model as a ``qwen2vl`` (Qwen2-VL, Qwen2.5-VL) or
``qwen3vl`` (Qwen3-VL: q/k norms) text GGUF whose rotary split into time, rows and columns is
``rope.dimension_sections``, and the vision tower as an ``mmproj`` of projector type
``qwen2vl_merger``, ``qwen2.5vl_merger`` or ``qwen3vl_merger``: q, k and v apart (one ``attn_qkv``
for Qwen3-VL), the patch embedding's two frames as two tensors, Qwen3-VL's deepstack mergers under
the absolute index of the layer they read (``is_deepstack_layers``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from gguf_writer import _hparams, _LAYER_NAMES
from vision_gguf import _tokenizer, _write

_LAYER = {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.fc1": "ffn_up",
          "mlp.fc2": "ffn_down", "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_TOP = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2", "merger.norm": "v.post_ln",
        "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2", "pos_embed": "v.position_embd"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def _tower_tensors(sd: dict[str, np.ndarray], deepstack: list[int], deepstack_style: bool) -> dict[str, np.ndarray]:
    """A Qwen-VL vision tower's tensors (transformers' runtime names) by llama.cpp's names (Qwen3-VL's
    ``deepstack_style``: q, k and v kept as one ``attn_qkv``)."""
    out: dict[str, np.ndarray] = {}
    for name, value in sd.items():
        if not name.startswith("model.visual."):
            continue
        stem, kind = name.removeprefix("model.visual.").rsplit(".", 1)
        if stem == "patch_embed.proj" and kind == "weight":
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = value[:, :, 0], value[:, :, 1]
        elif stem == "patch_embed.proj":
            out["v.patch_embd.bias"] = value
        elif stem in _TOP:
            out[f"{_TOP[stem]}.{kind}"] = value
        elif stem.startswith("deepstack_merger_list."):
            _, k, part = stem.split(".")
            out[f"v.deepstack.{deepstack[int(k)]}.{_DEEPSTACK[part]}.{kind}"] = value
        elif stem.endswith("attn.qkv") and not deepstack_style:
            i = stem.split(".")[1]
            for x, part in zip("qkv", np.split(value, 3)):
                out[f"v.blk.{i}.attn_{x}.{kind}"] = part
        else:
            _, i, rest = stem.split(".", 2)  # blocks.N.<module>
            out[f"v.blk.{i}.{_LAYER[rest]}.{kind}"] = value
    return out


def _pixel_bounds(pre: dict[str, Any]) -> tuple[int, int]:
    """(min, max) pixels of a Qwen-VL image processor config (old keys or ``size``)."""
    if "min_pixels" in pre:
        return pre["min_pixels"], pre["max_pixels"]
    return pre["size"]["shortest_edge"], pre["size"]["longest_edge"]


def write_qwen_vl_gguf(folder: str, out_dir: str) -> str:
    """The Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint in ``folder`` as ``model-F32.gguf`` and
    ``mmproj-model-F32.gguf`` in ``out_dir``; returns the text GGUF's path."""
    import gguf
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    cfg, tokenizer = model.config, AutoTokenizer.from_pretrained(folder)
    text = cfg.text_config
    kind = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2.5", "qwen3_vl": "qwen3"}[cfg.model_type]
    sd = {k: t.detach().float().numpy() for k, t in model.state_dict().items()}
    lm = "model.language_model."
    tensors = {"token_embd.weight": sd[lm + "embed_tokens.weight"], "output_norm.weight": sd[lm + "norm.weight"]}
    for i in range(text.num_hidden_layers):
        for hf, gg in _LAYER_NAMES.items():
            for part in ("weight", "bias"):
                if (value := sd.get(f"{lm}layers.{i}.{hf}.{part}")) is not None:
                    tensors[f"blk.{i}.{gg}.{part}"] = value
    path = os.path.join(out_dir, "model-F32.gguf")
    arch = "qwen3vl" if kind == "qwen3" else "qwen2vl"
    w = gguf.GGUFWriter(path, arch)
    _hparams(w, f"tiny-{cfg.model_type}", text.num_hidden_layers, text.hidden_size, text.intermediate_size,
             text.num_attention_heads, text.num_key_value_heads, context=text.max_position_embeddings,
             rope_theta=text.rope_parameters["rope_theta"], eps=text.rms_norm_eps, vocab=len(tokenizer),
             head_dim=getattr(text, "head_dim", None) if kind == "qwen3" else None)
    w.add_rope_dimension_sections([*text.rope_parameters["mrope_section"], 0])
    _tokenizer(w, tokenizer, "<|im_end|>")
    _write(w, tensors)
    _write_mmproj(folder, cfg, sd, kind, out_dir)
    return path


def _write_mmproj(folder: str, cfg: Any, sd: dict[str, np.ndarray], kind: str, out_dir: str) -> None:
    """The vision tower of a Qwen-VL checkpoint (``kind``: qwen2, qwen2.5 or qwen3, the last for
    Qwen3.5's tower too) as ``mmproj-model-F32.gguf`` in ``out_dir``."""
    import gguf

    text, v = cfg.text_config, cfg.vision_config
    with open(os.path.join(folder, "preprocessor_config.json")) as f:
        pre = json.load(f)
    w = gguf.GGUFWriter(os.path.join(out_dir, "mmproj-model-F32.gguf"), "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", text.hidden_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    # (the converter's Qwen2-VL values: its embed_dim, and the merger's output width as the feed-forward length)
    w.add_uint32("clip.vision.embedding_length", v.embed_dim if kind == "qwen2" else v.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", v.hidden_size if kind == "qwen2" else v.intermediate_size)
    w.add_uint32("clip.vision.block_count", v.depth)
    w.add_uint32("clip.vision.attention.head_count", v.num_heads)
    w.add_array("clip.vision.image_mean", [float(x) for x in pre["image_mean"]])
    w.add_array("clip.vision.image_std", [float(x) for x in pre["image_std"]])
    w.add_string("clip.projector_type", {"qwen2": "qwen2vl_merger", "qwen2.5": "qwen2.5vl_merger",
                                         "qwen3": "qwen3vl_merger"}[kind])
    # (the tiny ones' window and pixel bounds are not the real checkpoints', which readers assume)
    low, high = _pixel_bounds(pre)
    w.add_uint32("clip.vision.image_min_pixels", low)
    w.add_uint32("clip.vision.image_max_pixels", high)
    deepstack: list[int] = []
    if kind == "qwen2.5":
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", v.fullatt_block_indexes[0] + 1)
        w.add_uint32("clip.vision.window_size", v.window_size)
    else:
        w.add_bool("clip.use_gelu", True)
    if kind == "qwen3":
        deepstack = list(getattr(v, "deepstack_visual_indexes", None) or ())
        w.add_uint32("clip.vision.image_size", int(v.num_position_embeddings ** 0.5) * v.patch_size)
        w.add_uint32("clip.vision.spatial_merge_size", v.spatial_merge_size)
        w.add_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(v.depth)])
    else:
        w.add_uint32("clip.vision.image_size", 560)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_file_type(0)
    _write(w, _tower_tensors(sd, deepstack, kind == "qwen3"))


def write_qwen3_5_gguf(folder: str, out_dir: str) -> str:
    """The Qwen3.5 (dense or MoE) checkpoint in ``folder`` as a ``qwen35``/``qwen35moe`` text GGUF
    (``tests/hybrid_model.py``'s writer, with the checkpoint's tokenizer and rotary sections) and a
    ``qwen3vl_merger`` mmproj (Qwen3-VL's tower without deepstack layers) in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from hybrid_model import write_hybrid_gguf

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    cfg, tokenizer = model.config, AutoTokenizer.from_pretrained(folder)
    text = AutoModelForCausalLM.from_config(cfg.text_config, dtype=torch.float32).eval()
    weights = {k.replace("model.language_model.", "model.", 1): t for k, t in model.state_dict().items()
               if k.startswith(("model.language_model.", "lm_head."))}
    text.load_state_dict(weights, strict=True)
    path = os.path.join(out_dir, "model-F32.gguf")
    write_hybrid_gguf(path, kind="qwen35moe" if cfg.model_type == "qwen3_5_moe" else "qwen35", source=text,
                      tokenizer=lambda w: _tokenizer(w, tokenizer, "<|im_end|>"))
    _write_mmproj(folder, cfg, {k: t.detach().float().numpy() for k, t in model.state_dict().items()}, "qwen3",
                  out_dir)
    return path
