"""A tiny Idefics3 (SmolVLM-shaped, ``tests/vision_model.py``) written as llama.cpp's converter
writes a GGUF vision model: the language model as a ``llama`` text GGUF (its tokenizer with the
image tokens as control tokens, its chat template), and the vision tower and projector as an
``mmproj`` file (``general.architecture`` ``clip``, projector type ``idefics3``, the
preprocessing in its header). Written with the ``gguf`` package, F32 throughout, so the served
model's logits can be held to transformers' forward of the folder they came from.

And a tiny Gemma 3 (``tests/vision_gemma3.py``) likewise: a ``gemma3`` text GGUF (norms stored as
1 + weight, its sliding-window pattern) and an ``mmproj`` of projector type ``gemma3`` (its
projection as transformers keeps it, the pooled tokens' norm stored as 1 + weight). The Qwen-VL
families' files: ``tests/vision_gguf_qwen.py``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from gguf_writer import _hparams, _LAYER_NAMES, _permute, tokenizer_fields

# transformers' names in SigLIP's layers -> llama.cpp's.
_VISION_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}


def _write(w: Any, tensors: dict[str, np.ndarray]) -> None:
    for name, value in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_text_gguf(folder: str, out: str) -> None:
    """The language model of the Idefics3 checkpoint in ``folder`` as a llama GGUF at ``out``."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(folder).text_config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sd = {k.removeprefix("model.text_model."): v.float().numpy()
          for k, v in load_file(os.path.join(folder, "model.safetensors")).items() if k.startswith("model.text_model.")}
    tensors = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"]}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _LAYER_NAMES.items():
            value = sd.get(f"layers.{i}.{hf}.weight")
            if value is not None:  # Q and K rows in the converter's order (the rotary halves interleaved)
                value = _permute(value, heads if gg == "attn_q" else kv_heads) if gg in ("attn_q", "attn_k") else value
                tensors[f"blk.{i}.{gg}.weight"] = value
    w = gguf.GGUFWriter(out, "llama")
    _hparams(w, "tiny-idefics3", cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, heads, kv_heads,
             context=cfg.max_position_embeddings, rope_theta=cfg.rope_parameters["rope_theta"], eps=cfg.rms_norm_eps,
             vocab=len(tokenizer))
    _tokenizer(w, tokenizer, "<end_of_utterance>")
    _write(w, tensors)


def _tokenizer(w: Any, tokenizer: Any, eos: str) -> None:
    """The embedded tokenizer's fields with ``tokenizer``'s added tokens as control tokens, its
    end-of-turn token as EOS and its chat template."""
    import gguf

    t = tokenizer_fields()
    added = [tokenizer.convert_ids_to_tokens(i) for i in range(len(t["tokenizer.ggml.tokens"]), len(tokenizer))]
    w.add_tokenizer_model(t["tokenizer.ggml.model"])
    w.add_tokenizer_pre(t["tokenizer.ggml.pre"])
    w.add_token_list([*t["tokenizer.ggml.tokens"], *added])
    w.add_token_types([*t["tokenizer.ggml.token_type"], *[gguf.TokenType.CONTROL] * len(added)])
    w.add_token_merges(t["tokenizer.ggml.merges"])
    w.add_bos_token_id(t["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(int(tokenizer.convert_tokens_to_ids(eos)))
    w.add_unk_token_id(t["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(t["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    w.add_file_type(0)


def write_mmproj(folder: str, out: str) -> None:
    """The vision tower and projector of the Idefics3 checkpoint in ``folder`` as an mmproj file."""
    import json

    from transformers import AutoConfig

    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(folder)
    with open(os.path.join(folder, "processor_config.json")) as f:
        pre = json.load(f)["image_processor"]
    sd = {k: t.float().numpy() for k, t in load_file(os.path.join(folder, "model.safetensors")).items()}
    tensors = {"mm.model.fc.weight": sd["model.connector.modality_projection.proj.weight"],
               **_siglip_tensors(sd, "model.vision_model.")}
    w = _clip_header(out, cfg, pre, "idefics3")
    w.add_uint32("clip.vision.projector.scale_factor", cfg.scale_factor)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.preproc_image_size", pre["size"]["longest_edge"])
    w.add_file_type(0)
    _write(w, tensors)


def _siglip_tensors(sd: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The SigLIP tower's tensors (transformers' names after ``prefix``) by llama.cpp's names."""
    top = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
           "post_layernorm": "v.post_ln"}
    tensors = {}
    for name, value in sd.items():
        if not name.startswith(prefix):
            continue
        stem, kind = name.removeprefix(prefix).rsplit(".", 1)
        if stem in top:
            tensors[f"{top[stem]}.{kind}"] = value
            continue
        _, _, i, rest = stem.split(".", 3)  # encoder.layers.N.<module>
        tensors[f"v.blk.{i}.{_VISION_LAYER[rest]}.{kind}"] = value
    return tensors


def _clip_header(out: str, cfg: Any, pre: dict[str, Any], kind: str) -> Any:
    """A projector file's writer with the header every SigLIP-tower family shares."""
    import gguf

    v = cfg.vision_config
    w = gguf.GGUFWriter(out, "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", cfg.text_config.hidden_size)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", v.intermediate_size)
    w.add_uint32("clip.vision.block_count", v.num_hidden_layers)
    w.add_uint32("clip.vision.attention.head_count", v.num_attention_heads)
    w.add_array("clip.vision.image_mean", [float(x) for x in pre["image_mean"]])
    w.add_array("clip.vision.image_std", [float(x) for x in pre["image_std"]])
    w.add_string("clip.projector_type", kind)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v.layer_norm_eps)
    return w


def write_gemma3_gguf(folder: str, out_dir: str) -> str:
    """The Gemma 3 checkpoint in ``folder`` as ``model-F32.gguf`` (``gemma3``) and
    ``mmproj-model-F32.gguf`` in ``out_dir``; returns the text GGUF's path."""
    import json

    import gguf
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from gguf_writer import _GEMMA3_NAMES

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    cfg, tokenizer = model.config, AutoTokenizer.from_pretrained(folder)
    text = cfg.text_config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    lm = "model.language_model."
    tensors = {"token_embd.weight": sd[lm + "embed_tokens.weight"], "output_norm.weight": sd[lm + "norm.weight"] + 1}
    for i in range(text.num_hidden_layers):
        for hf, gg in _GEMMA3_NAMES.items():
            value = sd[f"{lm}layers.{i}.{hf}.weight"]
            tensors[f"blk.{i}.{gg}.weight"] = value + 1 if value.ndim == 1 else value  # Gemma's norms: 1 + weight
    path = os.path.join(out_dir, "model-F32.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    _hparams(w, "tiny-gemma3", text.num_hidden_layers, text.hidden_size, text.intermediate_size,
             text.num_attention_heads, text.num_key_value_heads, head_dim=text.head_dim,
             context=text.max_position_embeddings, rope_theta=text.rope_parameters["full_attention"]["rope_theta"],
             eps=text.rms_norm_eps, vocab=len(tokenizer))
    w.add_sliding_window(text.sliding_window)
    w.add_rope_freq_base_swa(text.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_uint32("gemma3.attention.sliding_window_pattern", text.layer_types.index("full_attention") + 1)
    _tokenizer(w, tokenizer, "<end_of_turn>")
    _write(w, tensors)
    with open(os.path.join(folder, "preprocessor_config.json")) as f:
        pre = json.load(f)
    projector = {"mm.input_projection.weight": sd["model.multi_modal_projector.mm_input_projection_weight"],
                 "mm.soft_emb_norm.weight": sd["model.multi_modal_projector.mm_soft_emb_norm.weight"] + 1,
                 **_siglip_tensors(sd, "model.vision_tower.")}
    w = _clip_header(os.path.join(out_dir, "mmproj-model-F32.gguf"), cfg, pre, "gemma3")
    scale = cfg.vision_config.image_size // cfg.vision_config.patch_size // round(cfg.mm_tokens_per_image ** 0.5)
    if scale != 4:  # as the converter: written only when not Gemma 3's own
        w.add_uint32("clip.vision.projector.scale_factor", scale)
    w.add_bool("clip.use_gelu", True)
    w.add_file_type(0)
    _write(w, projector)
    return path


def write_idefics3_gguf(folder: str, out_dir: str) -> str:
    """Both files of the checkpoint in ``folder`` into ``out_dir`` (``model-F32.gguf`` and
    ``mmproj-model-F32.gguf``, side by side as a Hub repo has them); returns the text GGUF's path."""
    text = os.path.join(out_dir, "model-F32.gguf")
    write_text_gguf(folder, text)
    write_mmproj(folder, os.path.join(out_dir, "mmproj-model-F32.gguf"))
    return text
