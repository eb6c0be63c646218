"""A tiny generated Gemma 3 vision-language model for the image path's tests: a SigLIP vision tower,
the family's projector (patches average-pooled to a square of image tokens, an RMS norm, a
projection) and a Gemma 3 language model with sliding-window and global layers, random weights,
saved with its processor as a Hub checkpoint has it.

What sets the family apart: an image's tokens attend to each other both ways (the whole image, not
only the tokens before), so the engine feeds each image in one step. The tiny model's sliding window
(12) is shorter than its image (16 tokens), so the window's bound inside an image is exercised too.

The tokenizer is SmolLM2's (the embedded model's) with Gemma 3's image and turn tokens, named as its
tokenizer config names them (``boi_token``, ``eoi_token``, ``image_token``); the chat template
renders an image part as ``<start_of_image>``, which the processor expands to two newlines, the
begin-of-image token, one ``<image_soft_token>`` per image token, the end-of-image token and two
newlines. The image processor config is google/gemma-3-4b-it's with its 896-pixel size scaled down.
"""

from __future__ import annotations

import json
import os
from typing import Any

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# google/gemma-3-4b-it's preprocessor_config.json (nulls: the processor's defaults, no pan and scan).
PREPROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 1 / 255, "size": {"height": 896, "width": 896}}
SHAPES: dict[str, dict[str, Any]] = {
    # 112-pixel images of 14-pixel patches (8 x 8) pooled 2 x 2: 16 image tokens.
    "tiny": {"image": 112, "tokens": 16,
             "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 2},
             "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 12,
                      "layer_types": ["sliding_attention", "full_attention"]}},
    # Gemma 3 4B's shapes (a SigLIP so400m tower at 896 pixels, 256 image tokens), for bench/vision_bench.py.
    "gemma3-4b": {"image": 896, "tokens": 256,
                  "vision": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                             "num_attention_heads": 16},
                  "text": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                           "query_pre_attn_scalar": 256, "sliding_window": 1024}},
}


def write_gemma3(path: str, seed: int = 0, shape: str = "tiny", dtype: str = "float32") -> str:
    """A Gemma 3 checkpoint of ``shape`` (random weights, in ``dtype``: bfloat16 halves a 4B
    shape's memory while it is made) with its tokenizer, chat template and processor configs in
    ``path``; returns ``path``."""
    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    from llmserve.plugins.backends.torch.loader import hf_directory

    tokenizer = AutoTokenizer.from_pretrained(hf_directory(None), extra_special_tokens=NAMED)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA_TEMPLATE
    dims = SHAPES[shape]
    special = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
               "eos_token_id": tokenizer.convert_tokens_to_ids("<end_of_turn>")}
    config = Gemma3Config(
        text_config={**dims["text"], "vocab_size": len(tokenizer), "max_position_embeddings": 8192, **special},
        vision_config={**dims["vision"], "image_size": dims["image"], "patch_size": 14,
                       "model_type": "siglip_vision_model", "vision_use_head": False},
        mm_tokens_per_image=dims["tokens"], boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids(NAMED["eoi_token"]),
        image_token_index=tokenizer.image_token_id, **special)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():  # transformers starts the projection at zero: an image would read as nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(4.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({**PREPROCESSOR, "image_seq_length": dims["tokens"],
                   "size": {"height": dims["image"], "width": dims["image"]}}, f)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": dims["tokens"], "processor_class": "Gemma3Processor"}, f)
    return path


def reference(path: str, ids: list[int], images: list[Any], generate: int = 0) -> Any:
    """transformers' own Gemma 3 over the prompt ``ids`` (its images already expanded, as the
    backend expands them) with ``images``: the logits at every position, or with ``generate`` its
    greedy continuation's new token ids. Token types mark the image tokens, as the processor
    marks them: transformers' model then lets them attend to each other both ways."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    fed: dict[str, Any] = {"input_ids": input_ids,
                           "token_type_ids": (input_ids == model.config.image_token_id).long()}
    if images:
        fed["pixel_values"] = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        if generate:
            out = model.generate(**fed, max_new_tokens=generate, min_new_tokens=generate, do_sample=False)
            return out[0, len(ids):].tolist()
        return model(**fed).logits[0].float()


def expanded_ids(path: str, text: str) -> list[int]:
    """``text``'s token ids with each ``<start_of_image>`` replaced by the ids of the processor's
    image sequence (its rule, restated: newlines, the markers around one soft token per image
    token), as the backend expands a prompt."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    tokenizer = processor.tokenizer
    image = tokenizer(processor.full_image_sequence, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        ids += image if t == tokenizer.boi_token_id else [t]
    return ids
