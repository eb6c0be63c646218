"""GGUF vision models: the projector file (``mmproj``) that llama.cpp's converter writes beside a
vision-language model's text GGUF holds the vision tower and its projector, and a header that
describes the image preprocessing. Here they become transformers modules again (fp32, the file's
weights) and the transformers processor that header describes, so that a GGUF vision model takes
the image path of a Hugging Face folder (``vision.py``) while its language model runs from the
text GGUF on the native path. Families: ``idefics3`` (SmolVLM, Idefics3), ``gemma3`` (Gemma 3),
``qwen2vl_merger`` and ``qwen2.5vl_merger`` (Qwen2-VL and Qwen2.5-VL, whose language model is a
``qwen2vl`` text GGUF: positions along three axes, ``mrope.py``), ``qwen3vl_merger`` (Qwen3-VL with
its ``qwen3vl`` text GGUF, and Qwen3.5 with its hybrid ``qwen35``/``qwen35moe`` one).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
import torch

from llmserve import ConfigError

from .gguf_file import GGUFFile

log = logging.getLogger("llmserve.backend.torch")


def find_mmproj(model_path: str, given: str | None) -> str | None:
    """The projector file served with the GGUF at ``model_path``: ``given`` (``--mmproj``), else
    the one file beside it whose name holds ``mmproj`` (None: none, or several: logged)."""
    if given:
        if not os.path.isfile(given):
            raise ConfigError(f"--mmproj {given}: no such file")
        return os.path.abspath(given)
    folder = os.path.dirname(os.path.abspath(model_path))
    found = sorted(n for n in os.listdir(folder) if "mmproj" in n.lower() and n.lower().endswith(".gguf"))
    if len(found) > 1:
        log.warning("several vision projector files beside %s (%s): serving text only; pick one with --mmproj",
                    model_path, ", ".join(found))
        return None
    return os.path.join(folder, found[0]) if found else None


def _tensors(f: GGUFFile) -> dict[str, torch.Tensor]:
    """Every tensor of the file in fp32, shaped as transformers keeps it (GGUF lists the fastest
    dimension first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = {}
    for name, t in f.tensors.items():
        values = dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
        out[name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(tuple(reversed(t.shape))))
    return out


# SigLIP's layers (Idefics3's vision tower) by the names llama.cpp's converter gives them.
_SIGLIP_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                 "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_SIGLIP = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
           "v.post_ln": "post_layernorm"}


def _siglip_name(name: str) -> str | None:
    stem, kind = name.rsplit(".", 1)
    if stem in _SIGLIP:
        return f"{_SIGLIP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in _SIGLIP_LAYER:
        return f"encoder.layers.{parts[2]}.{_SIGLIP_LAYER[parts[3]]}.{kind}"
    return None


def _siglip_config(h: dict[str, Any]) -> dict[str, Any]:
    """A SigLIP vision tower's transformers config values from a projector file's header."""
    return {"hidden_size": int(h["clip.vision.embedding_length"]),
            "intermediate_size": int(h["clip.vision.feed_forward_length"]),
            "num_hidden_layers": int(h["clip.vision.block_count"]),
            "num_attention_heads": int(h["clip.vision.attention.head_count"]),
            "image_size": int(h["clip.vision.image_size"]), "patch_size": int(h["clip.vision.patch_size"]),
            "layer_norm_eps": float(h.get("clip.vision.attention.layer_norm_epsilon") or 1e-6)}


def _assemble(model_class: Any, config: Any, parts: dict[str, tuple[Any, dict[str, torch.Tensor]]]) -> Any:
    """A vision-language model's base built on the meta device (its language model runs from the
    text GGUF: only its shape is wanted here), with its vision modules (``parts``: attribute ->
    (module, the file's weights)) real."""
    with torch.device("meta"):
        model = model_class(config)
    for attr, (module, state) in parts.items():
        module.load_state_dict(state, strict=True)
        setattr(model, attr, module)
    return model.eval().requires_grad_(False)


def _token_ids(tokenizer: Any, tokens: dict[str, str], family: str) -> dict[str, int]:
    """The ids of a family's image tokens (config key -> token), all of which the tokenizer must know."""
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids.values()):
        raise ValueError(f"the model's tokenizer lacks {family}'s image tokens ({', '.join(tokens.values())})")
    return ids


def _idefics3(f: GGUFFile, text_config: Any, tokenizer: Any) -> tuple[Any, Any]:
    from transformers import Idefics3Config, Idefics3Model, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    h = f.fields
    vision = _siglip_config(h)
    tile, patch, scale = vision["image_size"], vision["patch_size"], int(
        h.get("clip.vision.projector.scale_factor") or 2)
    config = Idefics3Config(vision_config=vision, text_config=text_config.to_dict(), scale_factor=scale,
                            **_token_ids(tokenizer, {"image_token_id": "<image>"}, "Idefics3"))
    weights = _tensors(f)
    model = _assemble(Idefics3Model, config, {
        "vision_model": (Idefics3VisionTransformer(config.vision_config),
                         {_siglip_name(k): v for k, v in weights.items() if _siglip_name(k)}),
        "connector": (Idefics3Connector(config), {"modality_projection.proj.weight": weights["mm.model.fc.weight"]})})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": int(h.get("clip.vision.preproc_image_size") or tile * 4)},
        max_image_size={"longest_edge": tile}, image_mean=list(h["clip.vision.image_mean"]),
        image_std=list(h["clip.vision.image_std"]))
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_len=(tile // patch) ** 2 // scale ** 2,
                                  chat_template=getattr(tokenizer, "chat_template", None))
    return model, processor


def _gemma3(f: GGUFFile, text_config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Gemma 3: a SigLIP tower; its patches average-pooled (``scale_factor`` x ``scale_factor``,
    4 unless the header says) into the image tokens, an RMS norm (stored as 1 + weight, as the
    converter writes Gemma's norms) and a projection into the language model."""
    from transformers import Gemma3Config, Gemma3Model, SiglipVisionModel
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    from .image_tokens import ImageSequenceProcessor

    h = f.fields
    vision = _siglip_config(h)
    side = vision["image_size"] // vision["patch_size"] // int(h.get("clip.vision.projector.scale_factor") or 4)
    marks = _token_ids(tokenizer, {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                                   "image_token_index": "<image_soft_token>"}, "Gemma 3")
    config = Gemma3Config(text_config=text_config.to_dict(), vision_config={**vision, "vision_use_head": False},
                          mm_tokens_per_image=side * side, **marks)
    weights = _tensors(f)
    model = _assemble(Gemma3Model, config, {
        "vision_tower": (SiglipVisionModel(config.vision_config),
                         {_siglip_name(k): v for k, v in weights.items() if _siglip_name(k)}),
        "multi_modal_projector": (Gemma3MultiModalProjector(config), {
            "mm_input_projection_weight": weights["mm.input_projection.weight"],
            "mm_soft_emb_norm.weight": weights["mm.soft_emb_norm.weight"] - 1.0})})
    size = vision["image_size"]
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=list(h["clip.vision.image_mean"]),
                                     image_std=list(h["clip.vision.image_std"]))
    sequence = f"\n\n<start_of_image>{'<image_soft_token>' * (side * side)}<end_of_image>\n\n"
    return model, ImageSequenceProcessor(images, tokenizer, "<start_of_image>", sequence)


# The Qwen-VL towers' modules by llama.cpp's names, per generation: Qwen2-VL's LayerNorms and
# fc1/fc2, Qwen2.5-VL's RMSNorms and gated MLP, Qwen3-VL's (and Qwen3.5's) LayerNorms, linear_fc1/2,
# a learned position embedding and the deepstack mergers; q, k and v are one qkv in transformers
# (stored apart for Qwen2/2.5-VL, as one ``attn_qkv`` for Qwen3-VL).
_QWEN_LAYER = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_qkv": "attn.qkv"}
_QWEN_STYLES = {
    "qwen2": ({**_QWEN_LAYER, "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
              {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}),
    "qwen2.5": (_QWEN_LAYER, {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}),
    "qwen3": ({**_QWEN_LAYER, "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"},
              {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2",
               "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}),
}
_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def _qwen_tower_weights(weights: dict[str, torch.Tensor], style: str, deepstack: list[int]) -> dict[str, torch.Tensor]:
    """A Qwen-VL vision tower's state dict from a projector file's tensors: the patch embedding's
    two temporal frames (stored as two 2-D convolutions) stacked back into one 3-D one, q, k and v
    joined into qkv, a deepstack merger's absolute layer index back to its place in ``deepstack``."""
    layer, top = _QWEN_STYLES[style]
    out = {"patch_embed.proj.weight": torch.stack((weights["v.patch_embd.weight"], weights["v.patch_embd.weight.1"]),
                                                  2)}
    for name, value in weights.items():
        stem, kind = name.rsplit(".", 1)
        parts = stem.split(".")
        if stem in top and name != "v.patch_embd.weight":
            out[f"{top[stem]}.{kind}"] = value
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in layer:
            out[f"blocks.{parts[2]}.{layer[parts[3]]}.{kind}"] = value
        elif len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] == "attn_q":
            blk = f"v.blk.{parts[2]}"
            out[f"blocks.{parts[2]}.attn.qkv.{kind}"] = torch.cat(
                [weights[f"{blk}.attn_{x}.{kind}"] for x in "qkv"])
        elif len(parts) == 4 and parts[:2] == ["v", "deepstack"] and int(parts[2]) in deepstack:
            out[f"deepstack_merger_list.{deepstack.index(int(parts[2]))}.{_DEEPSTACK[parts[3]]}.{kind}"] = value
    return out


def _sections(text_config: Any) -> list[int]:
    """The language model's rotary sections (time, rows, columns) from its text GGUF's header."""
    sections = getattr(text_config, "mrope_section", None)
    if not sections:
        raise ValueError("the language model's file gives no rope.dimension_sections: its positions have one axis")
    return list(sections)


_QWEN_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def _qwen_text(text_config: Any, interleaved: bool) -> dict[str, Any]:
    """A Qwen-VL config's text part from the text GGUF's config, its rotary sections stated."""
    text = {k: v for k, v in text_config.to_dict().items() if k not in ("model_type", "architectures", "mrope_axes")}
    text["rope_parameters"] = {**text_config.rope_parameters, "mrope_section": _sections(text_config),
                               **({"mrope_interleaved": True} if interleaved else {})}
    return text


def _qwen_processor(h: dict[str, Any], tokenizer: Any, family: str, patch: int, merge: int) -> Any:
    """A Qwen-VL family's image-only processor from the header: pictures resized between its pixel
    bounds (else 4 and 1,280 image tokens, transformers' Qwen2-VL defaults), the family's token rule."""
    from transformers import Qwen2VLImageProcessorPil

    from .image_tokens import FAMILIES, ImageTokenProcessor

    unit = (patch * merge) ** 2  # pixels per image token
    images = Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=2, merge_size=merge,
        image_mean=list(h["clip.vision.image_mean"]), image_std=list(h["clip.vision.image_std"]),
        size={"shortest_edge": int(h.get("clip.vision.image_min_pixels") or unit * 4),
              "longest_edge": int(h.get("clip.vision.image_max_pixels") or unit * 1280)})
    token, count = FAMILIES[family]
    return ImageTokenProcessor(images, tokenizer, token, count, merge)


def _qwen_vl(f: GGUFFile, text_config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Qwen2-VL (``qwen2vl_merger``) and Qwen2.5-VL (``qwen2.5vl_merger``: windowed attention but in
    every ``n_wa_pattern``-th block, RMSNorms, a gated MLP): 14-pixel patches of two frames, merged
    2 x 2 into one token; the language model's positions along three axes (``mrope.py``)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    h = f.fields
    v25 = h["clip.projector_type"] == "qwen2.5vl_merger"
    family = "qwen2_5_vl" if v25 else "qwen2_vl"
    weights = _tensors(f)
    hidden, depth, merge = (int(h["clip.vision.embedding_length"]), int(h["clip.vision.block_count"]),
                            int(h.get("clip.vision.spatial_merge_size") or 2))
    common = {"depth": depth, "num_heads": int(h["clip.vision.attention.head_count"]),
              "patch_size": int(h["clip.vision.patch_size"]), "spatial_merge_size": merge, "temporal_patch_size": 2}
    if v25:
        pattern = int(h["clip.vision.n_wa_pattern"])
        vision = {**common, "hidden_size": hidden, "intermediate_size": int(h["clip.vision.feed_forward_length"]),
                  "out_hidden_size": int(h["clip.vision.projection_dim"]), "hidden_act": "silu",
                  "window_size": int(h.get("clip.vision.window_size") or 112),
                  "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0]}
    else:  # the MLP's width is the ratio of its tensors (the header's feed-forward length is not it)
        width = int(weights["v.blk.0.ffn_up.weight"].shape[0])
        if width % hidden:
            raise ValueError(f"the MLP's width {width} is not a multiple of the tower's {hidden}")
        vision = {**common, "embed_dim": hidden, "hidden_size": int(h["clip.vision.projection_dim"]),
                  "mlp_ratio": width // hidden}
    config = (Qwen2_5_VLConfig if v25 else Qwen2VLConfig)(
        text_config=_qwen_text(text_config, interleaved=False), vision_config=vision,
        **_token_ids(tokenizer, _QWEN_TOKENS, "Qwen-VL"))
    tower = (Qwen2_5_VisionTransformerPretrainedModel if v25
             else Qwen2VisionTransformerPretrainedModel)(config.vision_config)
    model = _assemble(Qwen2_5_VLModel if v25 else Qwen2VLModel, config,
                      {"visual": (tower, _qwen_tower_weights(weights, "qwen2.5" if v25 else "qwen2", []))})
    return model, _qwen_processor(h, tokenizer, family, common["patch_size"], merge)


def _qwen3_vl(f: GGUFFile, text_config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Qwen3-VL and Qwen3.5 (``qwen3vl_merger``): 16-pixel patches of two frames with a learned
    position embedding, merged 2 x 2 into one token; Qwen3-VL's features from inner layers
    (``is_deepstack_layers``) added to the image tokens after the language model's first layers.
    The language model (a ``qwen3vl`` file, or Qwen3.5's hybrid ``qwen35``/``qwen35moe``) reads
    positions along three axes with its rotary frequencies interleaved."""
    from transformers import (Qwen3_5Config, Qwen3_5Model, Qwen3_5MoeConfig, Qwen3_5MoeModel, Qwen3VLConfig,
                              Qwen3VLModel)
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    h = f.fields
    weights = _tensors(f)
    depth, patch = int(h["clip.vision.block_count"]), int(h["clip.vision.patch_size"])
    merge = int(h.get("clip.vision.spatial_merge_size") or 2)
    deepstack = [i for i, on in enumerate(h.get("clip.vision.is_deepstack_layers") or ()) if on]
    vision = {"depth": depth, "hidden_size": int(h["clip.vision.embedding_length"]),
              "intermediate_size": int(h["clip.vision.feed_forward_length"]),
              "num_heads": int(h["clip.vision.attention.head_count"]), "patch_size": patch,
              "spatial_merge_size": merge, "temporal_patch_size": 2,
              "out_hidden_size": int(h["clip.vision.projection_dim"]),
              "num_position_embeddings": int(weights["v.position_embd.weight"].shape[0])}
    kind = getattr(text_config, "model_type", "")
    config_class, model_class, tower_class, family = {
        "qwen3_5_text": (Qwen3_5Config, Qwen3_5Model, Qwen3_5VisionModel, "qwen3_5"),
        "qwen3_5_moe_text": (Qwen3_5MoeConfig, Qwen3_5MoeModel, Qwen3_5MoeVisionModel, "qwen3_5_moe"),
    }.get(kind, (Qwen3VLConfig, Qwen3VLModel, Qwen3VLVisionModel, "qwen3_vl"))
    if family == "qwen3_vl":
        vision["deepstack_visual_indexes"] = deepstack
    elif deepstack:
        raise ValueError("Qwen3.5's vision tower has no deepstack layers")
    config = config_class(text_config=_qwen_text(text_config, interleaved=True), vision_config=vision,
                          **_token_ids(tokenizer, _QWEN_TOKENS, "Qwen-VL"))
    tower = tower_class(config.vision_config)
    model = _assemble(model_class, config, {"visual": (tower, _qwen_tower_weights(weights, "qwen3", deepstack))})
    return model, _qwen_processor(h, tokenizer, family, patch, merge)


# clip.projector_type -> the builder of (a module with transformers' get_image_features, the processor)
PROJECTORS: dict[str, Callable[[GGUFFile, Any, Any], tuple[Any, Any]]] = {
    "idefics3": _idefics3, "gemma3": _gemma3, "qwen2vl_merger": _qwen_vl, "qwen2.5vl_merger": _qwen_vl,
    "qwen3vl_merger": _qwen3_vl}


def load_mmproj(path: str, text_config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """(the vision tower and projector, the processor) of the projector file at ``path`` for a
    language model of ``text_config`` whose tokenizer is ``tokenizer``; an unknown projector type
    or a broken file is a ``ConfigError`` naming it."""
    try:
        f = GGUFFile(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"vision projector {path}: {exc}") from None
    kind = str(f.fields.get("clip.projector_type") or "")
    if f.architecture != "clip" or not f.fields.get("clip.has_vision_encoder"):
        raise ConfigError(f"vision projector {path}: not a vision projector file (general.architecture "
                          f"{f.architecture!r})")
    if kind not in PROJECTORS:
        raise ConfigError(f"vision projector {path}: projector type {kind!r} is not served (served: "
                          f"{', '.join(sorted(PROJECTORS))}); serve the model's Hugging Face folder for its images")
    try:
        return PROJECTORS[kind](f, text_config, tokenizer)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"vision projector {path}: the {kind} projector does not fit its header or the model "
                          f"({exc})") from None


def projector(model_path: str, given: str | None, text_config: Any, tokenizer: Any) -> tuple[Any, Any] | None:
    """(vision tower and projector, processor) for the GGUF at ``model_path``: from ``given``
    (``--mmproj``: any fault is a ``ConfigError``), else from the projector file beside it (a
    fault there is logged and the model serves text only); None when there is none."""
    path = find_mmproj(model_path, given)
    if path is None:
        return None
    try:
        loaded = load_mmproj(path, text_config, tokenizer)
    except ConfigError as exc:
        if given:
            raise
        log.warning("%s: serving text only", exc)
        return None
    log.info("images: the vision tower and projector of %s", path)
    return loaded

