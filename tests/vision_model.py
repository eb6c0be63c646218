"""Tiny generated vision-language models for the image path's tests: a SmolVLM-256M-shaped
Idefics3 (SigLIP-style vision tower, pixel-shuffle projector, a Llama language model) with random
weights, saved with its processor as transformers saves a Hub checkpoint.

The tokenizer is SmolLM2's (the embedded model's), with the image tokens SmolVLM adds
(``<image>``, ``<fake_token_around_image>``, ``<global-img>``, ``<row_R_col_C>``) and its chat
template's format (``User:<image>text<end_of_utterance>``). The image processor keeps SmolVLM's
settings (tiles of ``max_image_size`` after resizing the longest edge to ``size``, then a global
image), scaled down so a test image makes a few small tiles: 64-pixel tiles of 16-pixel patches,
a pixel shuffle of 2, so each tile becomes 4 image tokens.

And a Qwen2.5-VL (windowed vision tower, 2x2 patch merger, a Qwen2 language model with positions
along three axes) on the same tokenizer with Qwen's vision tokens, its chat template's format and
its image processor config; its transformers processor needs torchvision for its video half, so
the references here restate the processor's one rule (one ``<|image_pad|>`` per merged patch).
"""

from __future__ import annotations

import io
import os
from typing import Any

# SmolVLM's chat template, in its format: a role, a colon, the message's parts (an image as
# the processor's placeholder), the end of the utterance.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
# Shapes: ``tiny`` for the tests (64-pixel tiles of 16-pixel patches and a pixel shuffle of 2: 4
# image tokens per tile); ``smolvlm-256m`` is SmolVLM-256M-Instruct's (SigLIP base at 512 pixels,
# a shuffle of 4: 64 tokens per tile; SmolLM2-135M's language model), for bench/vision_bench.py.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"tile": 64, "longest": 128, "scale": 2,
             "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
             "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2}},
    "smolvlm-256m": {"tile": 512, "longest": 2048, "scale": 4,
                     "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                "num_attention_heads": 12},
                     "text": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                              "num_attention_heads": 9, "num_key_value_heads": 3}},
}


def write_idefics3(path: str, seed: int = 0, shape: str = "tiny") -> str:
    """An Idefics3 checkpoint of ``shape`` (random weights) with its processor in ``path``;
    returns ``path``."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from llmserve.plugins.backends.torch.loader import hf_directory

    tokenizer = AutoTokenizer.from_pretrained(hf_directory(None))  # SmolLM2's, converted from the embedded GGUF
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    dims = SHAPES[shape]
    tile, scale = dims["tile"], dims["scale"]
    images = Idefics3ImageProcessorPil(size={"longest_edge": dims["longest"]}, max_image_size={"longest_edge": tile})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                  image_seq_len=(tile // 16) ** 2 // scale ** 2, chat_template=CHAT_TEMPLATE)
    config = Idefics3Config(
        vision_config={**dims["vision"], "image_size": tile, "patch_size": 16},
        # ``architectures`` as SmolVLM's checkpoints name their language model (llama.cpp's converter reads it).
        text_config={"model_type": "llama", "architectures": ["LlamaForCausalLM"], **dims["text"],
                     "vocab_size": len(tokenizer),
                     "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "eos_token_id": tokenizer.convert_tokens_to_ids("<end_of_utterance>")},
        scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    # Larger than the default init (with which the tiny language model answers one token whatever
    # it reads): an image moves the logits enough that two pictures get two greedy answers.
    with torch.no_grad():
        for p in model.model.connector.parameters():
            p.mul_(8.0)
        for name, p in model.model.text_model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(4.0)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# Qwen2.5-VL's chat template, in its format: an image part is the vision markers around one
# ``<|image_pad|>``, which the processor repeats once per merged patch.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's preprocessor_config.json as its checkpoints ship it (CLIP's mean and std, 14-pixel
# patches merged 2x2), its pixel bounds scaled down so a test picture makes a few dozen tokens.
QWEN_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 28 * 28 * 64, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
QWEN_SHAPES: dict[str, dict[str, Any]] = {
    # head_dim 16: RoPE's 8 frequencies split 2/3/3 between time, rows and columns.
    "tiny": {"mrope": [2, 3, 3], "max_pixels": 28 * 28 * 64,
             "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "window_size": 56,
                        "fullatt_block_indexes": [1]},
             "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2}},
    # Qwen2.5-VL-3B-Instruct's shapes, for bench/vision_bench.py.
    "qwen2.5-vl-3b": {"mrope": [16, 24, 24], "max_pixels": 12845056,
                      "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                 "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
                      "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                               "num_attention_heads": 16, "num_key_value_heads": 2}},
}


def _qwen_tokenizer() -> tuple[Any, dict[str, int], dict[str, Any]]:
    """SmolLM2's tokenizer with Qwen's vision tokens and chat template: (the tokenizer, those
    tokens' ids, the special token ids a config takes)."""
    from transformers import AutoTokenizer

    from llmserve.plugins.backends.torch.loader import hf_directory

    tokenizer = AutoTokenizer.from_pretrained(hf_directory(None))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    special = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
               "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tokenizer, ids, special


def _qwen_vision_ids(ids: dict[str, int]) -> dict[str, int]:
    """A Qwen-VL config's vision token ids."""
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


def _stir(model: Any, *extra: Any, projections: bool = True) -> None:
    """Larger weights than the default init, as for Idefics3: an image must move the tiny Qwen
    model's answers. The merger (and ``extra`` modules) times 8; with ``projections``, the
    language model's projections times 4."""
    import torch

    with torch.no_grad():
        if projections:
            for name, p in model.model.language_model.named_parameters():
                if name.endswith("proj.weight"):
                    p.mul_(4.0)
        for module in (model.model.visual.merger, *extra):
            for p in module.parameters():
                p.mul_(8.0)


def _save_qwen(model: Any, tokenizer: Any, path: str, preprocessor: dict[str, Any]) -> str:
    """Save a Qwen-VL checkpoint as the Hub has it: weights, tokenizer, image processor config."""
    import json

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f)
    return path


def write_qwen2_5_vl(path: str, seed: int = 0, shape: str = "tiny") -> str:
    """A Qwen2.5-VL checkpoint of ``shape`` (random weights) with its tokenizer, chat template and
    image processor config in ``path``; returns ``path``."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer, ids, special = _qwen_tokenizer()
    dims = QWEN_SHAPES[shape]
    config = Qwen2_5_VLConfig(
        text_config={**dims["text"], "vocab_size": len(tokenizer), "max_position_embeddings": 8192,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope"]},
                     "tie_word_embeddings": True, **special},
        vision_config={**dims["vision"], "out_hidden_size": dims["text"]["hidden_size"], "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        **_qwen_vision_ids(ids), tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _stir(model)
    return _save_qwen(model, tokenizer, path, {**QWEN_PREPROCESSOR, "max_pixels": dims["max_pixels"]})


def write_qwen2_vl(path: str, seed: int = 0) -> str:
    """A tiny Qwen2-VL checkpoint (random weights: a vision tower of full attention and QuickGELU
    MLPs, patches merged 2x2, a Qwen2 language model with positions along three axes) with its
    tokenizer, chat template and image processor config (Qwen2.5-VL's, whose processor it shares)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer, ids, special = _qwen_tokenizer()
    dims = QWEN_SHAPES["tiny"]
    config = Qwen2VLConfig(
        text_config={**dims["text"], "vocab_size": len(tokenizer), "max_position_embeddings": 8192,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope"]},
                     "tie_word_embeddings": True, **special},
        vision_config={"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2,
                       "hidden_size": dims["text"]["hidden_size"], "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2},
        **_qwen_vision_ids(ids), tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    _stir(model)
    preprocessor = {**QWEN_PREPROCESSOR, "max_pixels": dims["max_pixels"], "processor_class": "Qwen2VLProcessor"}
    return _save_qwen(model, tokenizer, path, preprocessor)


# Qwen3-VL: 16-pixel patches merged 2x2, the mean and std of 0.5 its checkpoints ship; the vision
# tower's features at ``deepstack_visual_indexes`` go into the first language-model layers' outputs.
QWEN3_PREPROCESSOR = {
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64},
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}


def write_qwen3_vl(path: str, seed: int = 0) -> str:
    """A tiny Qwen3-VL checkpoint (random weights) with its tokenizer, chat template and image
    processor config in ``path``; returns ``path``."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer, ids, special = _qwen_tokenizer()
    config = Qwen3VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": len(tokenizer),
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, **special,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        **_qwen_vision_ids(ids), tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _stir(model, model.model.visual.deepstack_merger_list)
    return _save_qwen(model, tokenizer, path, QWEN3_PREPROCESSOR)


def write_qwen3_5(path: str, seed: int = 0, moe: bool = False) -> str:
    """A tiny Qwen3.5 checkpoint, vision tower and all (random weights): Gated DeltaNet and gated
    attention layers, part of each head rotated with its frequencies' axes interleaved; with its
    tokenizer, chat template and Qwen3-VL's image processor config (Qwen3.5 ships the same).
    ``moe``: Qwen3.5-MoE's (experts with a shared one instead of the MLP)."""
    import torch
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    tokenizer, ids, special = _qwen_tokenizer()
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32} if moe else {}
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config={**experts, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": len(tokenizer),
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 8192,
                     "tie_word_embeddings": True, **special,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 3, 3],
                                         "mrope_interleaved": True, "partial_rotary_factor": 0.5}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64},
        **_qwen_vision_ids(ids), tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = (Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration)(config).eval()
    _stir(model, projections=False)
    return _save_qwen(model, tokenizer, path, QWEN3_PREPROCESSOR)


def _qwen_inputs(path: str, text: str, images: list[Any]) -> tuple[Any, dict[str, Any]]:
    """A Qwen-VL checkpoint's model and its inputs for ``text`` (one ``<|image_pad|>`` per image):
    each placeholder repeated once per merged patch of its image's grid (the family's processor
    rule, restated here); the model computes its own three-axis positions from them."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    merge = model.config.vision_config.spatial_merge_size
    pad = model.config.image_token_id
    fed: dict[str, Any] = {}
    counts: list[int] = []
    if images:
        fed = dict(AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt"))
        counts = [int(g.prod()) // merge ** 2 for g in fed["image_grid_thw"]]
    ids: list[int] = []
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        ids += [pad] * counts.pop(0) if t == pad else [t]
    input_ids = torch.tensor([ids])
    return model, {"input_ids": input_ids, "mm_token_type_ids": (input_ids == pad).int(), **fed}


def qwen_reference_logits(path: str, text: str, images: list[Any]) -> tuple[list[int], Any]:
    """transformers' forward of a Qwen-VL checkpoint over ``text`` with ``images``: (the prompt's
    ids, the logits at every position)."""
    import torch

    model, inputs = _qwen_inputs(path, text, images)
    with torch.no_grad():
        out = model(**inputs)
    return inputs["input_ids"][0].tolist(), out.logits[0].float()


def qwen_reference_generate(path: str, text: str, images: list[Any], n: int) -> list[int]:
    """transformers' greedy ``generate`` of a Qwen-VL checkpoint: the ``n`` new token ids."""
    import torch

    model, inputs = _qwen_inputs(path, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def picture(seed: int, size: tuple[int, int] = (150, 100)) -> Any:
    """A random RGB picture (``PIL.Image``) of ``size`` (width, height)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(seed: int, size: tuple[int, int] = (150, 100)) -> bytes:
    """``picture(seed, size)`` as PNG bytes."""
    out = io.BytesIO()
    picture(seed, size).save(out, format="PNG")
    return out.getvalue()


def reference_logits(path: str, text: str, images: list[Any]) -> tuple[list[int], Any]:
    """transformers' own forward over ``text`` (holding one ``<image>`` per image) with ``images``:
    (the prompt's token ids as its processor expands them, the logits at every position)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    enc = processor(text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model(**{k: v for k, v in enc.items() if k not in ("rows", "cols")})
    return enc["input_ids"][0].tolist(), out.logits[0].float()


def model_dir(tmp_path_factory: Any, name: str = "tiny-idefics3") -> str:
    """A module's tiny Idefics3 folder (one per test module)."""
    return write_idefics3(os.fspath(tmp_path_factory.mktemp(name)))


def reference_generate(path: str, text: str, images: list[Any], n: int) -> list[int]:
    """transformers' greedy ``generate`` over ``text`` with ``images``: the ``n`` new token ids."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    enc = processor(text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False)
    inputs = {k: v for k, v in enc.items() if k not in ("rows", "cols")}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()
