"""An image-only processor for vision-language models whose transformers processor cannot be
built on this machine: the Qwen-VL family's processors carry a video half whose class needs
torchvision, which a CPU install of torch does not have. Their images need only the model's own
image processor (its PIL implementation, no torchvision) and the family's rule for how many image
tokens stand for a picture; this module is that pair, called as transformers' processors are
(``vision.py`` calls it with one placeholder and one image).

And the processor of a family whose every picture stands for one fixed token sequence (Gemma 3's:
newlines, markers and 256 image tokens), for a GGUF vision model whose projector file's header
gives its image preprocessing but no transformers processor (``gguf_vision.py``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("llmserve.backend.torch")


def _merged_grid(tensors: dict[str, torch.Tensor], merge: int) -> int:
    """Qwen-VL: one image token per ``merge x merge`` patches of the picture's (t, h, w) grid."""
    t, h, w = (int(v) for v in tensors["image_grid_thw"][0])
    return t * h * w // (merge * merge)


# model_type -> (the image token, how many of it one picture's tensors make given the config's
# spatial merge size). The Qwen-VL families: the vision tower's patches merged 2x2 into one token.
FAMILIES: dict[str, tuple[str, Callable[[dict[str, torch.Tensor], int], int]]] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
                    ("<|image_pad|>", _merged_grid)),
}


class ImageTokenProcessor:
    """The model's image processor and its family's token rule, called like a transformers
    processor: ``processor(text=[image_token], images=[image])`` gives the ``input_ids`` that stand
    for the picture and its pixel inputs (``pixel_values``, ``image_grid_thw``)."""

    def __init__(self, images: Any, tokenizer: Any, image_token: str,
                 count: Callable[[dict[str, torch.Tensor], int], int], merge: int) -> None:
        self.image_processor = images
        self.tokenizer = tokenizer
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self._count = count
        self._merge = merge
        self.unused_input_names: tuple[str, ...] = ()

    def __call__(self, text: list[str], images: list[Any], **_: Any) -> dict[str, torch.Tensor]:
        if text != [self.image_token] or len(images) != 1:
            raise ValueError("the image-token processor takes one placeholder and one image")
        out = self.image_processor(images=images, return_tensors="pt")
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        n = self._count(tensors, self._merge)
        return {"input_ids": torch.full((1, n), self.image_token_id, dtype=torch.long), **tensors}


def image_token_processor(model_dir: str, config: Any, tokenizer: Any, trust_remote_code: bool) -> Any:
    """The image-only processor of ``config``'s family from ``model_dir``'s image processor
    config, or None when the family has no rule here or the folder has no image processor."""
    from transformers import AutoImageProcessor

    family = FAMILIES.get(str(getattr(config, "model_type", "")))
    if family is None:
        return None
    try:
        images = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        log.warning("the image processor of %s cannot be loaded (%s): serving text only", model_dir, exc)
        return None
    merge = int(getattr(config.vision_config, "spatial_merge_size", 1) or 1)
    return ImageTokenProcessor(images, tokenizer, family[0], family[1], merge)


class ImageSequenceProcessor:
    """A picture as one fixed token sequence: ``processor(text=[placeholder], images=[image])``
    gives the ids of ``sequence`` (the placeholder expanded, markers and image tokens) and the
    image processor's ``pixel_values``."""

    def __init__(self, images: Any, tokenizer: Any, placeholder: str, sequence: str) -> None:
        self.image_processor = images
        self.tokenizer = tokenizer
        self.image_token = placeholder
        self._ids = [int(t) for t in tokenizer(sequence, add_special_tokens=False)["input_ids"]]
        self.unused_input_names: tuple[str, ...] = ("num_crops",)

    def __call__(self, text: list[str], images: list[Any], **_: Any) -> dict[str, torch.Tensor]:
        if text != [self.image_token] or len(images) != 1:
            raise ValueError("the image-sequence processor takes one placeholder and one image")
        out = self.image_processor(images=images, return_tensors="pt")
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        return {"input_ids": torch.tensor([self._ids]), **tensors}
