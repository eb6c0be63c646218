"""Vision-language models on the torch backend.

A prompt's images reach the language model in three steps, each where it belongs:
- ``expand`` (the server's ``MediaProcessor``, in a tokenizer thread): the model's own
  transformers processor turns each image into its pixel inputs and the token string that stands
  for it (tiles, row markers and the repeated image token for Idefics3/SmolVLM; the repeated pad
  token for Qwen-VL); the one placeholder the chat template rendered is replaced by that string.
  A picture seen before (by digest) skips the processor (half a second for a SmolVLM picture of
  13 tiles): its tokens are remembered, and its features are in the encoder cache.
- ``features`` (the engine thread, inside a step): the vision tower and its projector encode an
  image once; the encoder cache keeps the result by the image's digest, so a later turn that sends
  the same image again (every turn of a chat resends its history) does not encode it again.
- ``embeddings`` (the same step): for each item, the rows of the packed step that hold one of an
  image's tokens get the image's features instead of the token's embedding; a prefill chunk that
  covers part of an image gets just those rows.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from llmserve import InvalidRequestError, MediaInput, StepItem, image_digest

from . import image_batch
from .mrope import uses_mrope

log = logging.getLogger("llmserve.backend.torch")

#: Bytes of encoded images the encoder cache keeps (least recently used first out).
ENCODER_CACHE_BYTES = 256 << 20
#: Pictures whose token expansion is remembered (a list of ids each).
KNOWN_EXPANSIONS = 4096
#: Model types whose image tokens attend to each other both ways (transformers marks them with
#: token types and lets each contiguous run of them see the whole run).
BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})


@dataclass(slots=True)
class ImageInputs:
    """One image as the model takes it (``MediaInput.data``): the decoded picture, the
    processor's tensors (None for a picture seen before, and dropped once encoded: the engine
    thread runs the processor again only if the encoder cache no longer holds its features; a
    13-tile picture's tensors are 41 MB, the picture itself 2.4 MB), and the positions (absolute,
    in the prompt) its features go to, in order; for a model whose positions have three axes, the
    picture's grid of image tokens."""

    image: Any
    tensors: dict[str, torch.Tensor] | None
    positions: torch.Tensor
    grid: tuple[int, int, int] | None = None  # a multimodal-RoPE model's merged (t, h, w) grid (mrope.py)
    looked_up: bool = False  # counted in the encoder cache's queries (once per image of a request)


class VisionInputs:
    """The ``MediaProcessor`` of a vision-language model, and the encoder behind it."""

    def __init__(self, model: Any, processor: Any, tokenizer: Any, device: torch.device) -> None:
        self.model = model
        self.processor = processor
        self.device = device
        self.placeholder = str(processor.image_token)
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.placeholder))
        config = model.config
        image_id = getattr(config, "image_token_id", None)
        if image_id is None:
            image_id = getattr(config, "image_token_index", None)
        # The token whose positions take the features: the placeholder itself unless the config says.
        self.image_token_id = int(image_id) if image_id is not None else self.placeholder_id
        self._unused = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                        *getattr(processor, "unused_input_names", ())}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_bytes = 0  # the cache is the engine thread's alone: no lock
        # digest -> expansion and grid (tokenizer threads)
        self._known: OrderedDict[str, tuple[list[int], tuple[int, int, int] | None]] = OrderedDict()
        self._known_lock = threading.Lock()
        # Qwen-VL: positions along three axes (mrope.py), an image's tokens placed on its grid of
        # merged patches (``image_grid_thw`` over the merge size).
        self.mrope = uses_mrope(model)
        self.bidirectional = getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGES
        self._merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1)
        self.hits = 0    # lookups the encoder cache answered (a prefill chunk after the image's first counts)
        self.encoded = 0  # images run through the vision tower
        # The engine's counters (``MediaProcessor``): each request's images at their first lookup,
        # and those the encoder cache held then.
        self.encoder_queries = 0
        self.encoder_hits = 0

    @classmethod
    def build(cls, model: Any, processor: Any, tokenizer: Any, device: torch.device) -> "VisionInputs | None":
        """The model's image path, or None (logged) when its processor names no image token."""
        if processor is None or not getattr(processor, "image_token", None):
            log.warning("the processor of this vision model names no image token: serving text only")
            return None
        if not hasattr(model, "get_image_features"):
            log.warning("%s has no image encoder transformers can call: serving text only", type(model).__name__)
            return None
        return cls(model, processor, tokenizer, device)

    # -------------------------------------------------------------- tokenizer thread
    def expand(self, prompt_ids: list[int], images: Sequence[Any],
               param: str) -> tuple[list[int], tuple[MediaInput, ...]]:
        where = [i for i, t in enumerate(prompt_ids) if t == self.placeholder_id]
        if len(where) != len(images):
            raise InvalidRequestError(f"the prompt has {len(where)} image placeholders ({self.placeholder}) for "
                                      f"{len(images)} images", param=param)
        out: list[int] = []
        media: list[MediaInput] = []
        last = 0
        for at, image in zip(where, images):
            out += prompt_ids[last:at]
            digest = image_digest(image)
            with self._known_lock:
                known = self._known.get(digest)
                if known is not None:
                    self._known.move_to_end(digest)
            tensors = None
            if known is None:
                ids, tensors = self._process(image, param)
                known = ids, self._grid(tensors)
                with self._known_lock:
                    self._known[digest] = known
                    while len(self._known) > KNOWN_EXPANSIONS:
                        self._known.popitem(last=False)
            ids, grid = known
            rows = [len(out) + k for k, t in enumerate(ids) if t == self.image_token_id]
            media.append(MediaInput(digest, len(out), len(out) + len(ids),
                                    ImageInputs(image, tensors, torch.tensor(rows), grid),
                                    runs(rows) if self.bidirectional else ()))
            out += ids
            last = at + 1
        out += prompt_ids[last:]
        return out, tuple(media)

    def _grid(self, tensors: dict[str, torch.Tensor]) -> tuple[int, int, int] | None:
        """A multimodal-RoPE model's grid of image tokens for one picture's tensors."""
        if not self.mrope:
            return None
        t, h, w = (int(v) for v in tensors["image_grid_thw"][0])
        return t, h // self._merge, w // self._merge

    def _process(self, image: Any, param: str) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The token ids that stand for ``image`` and its pixel inputs, by the model's processor."""
        try:
            enc = self.processor(text=[self.placeholder], images=[image], return_tensors="pt",
                                 add_special_tokens=False)
        except (ValueError, TypeError, OSError) as exc:
            raise InvalidRequestError(f"the model's image processor cannot read the image ({exc})",
                                      param=param) from None
        ids = [int(t) for t in enc["input_ids"][0]]
        tensors = {k: v for k, v in enc.items() if k not in self._unused and isinstance(v, torch.Tensor)}
        return ids, tensors

    # -------------------------------------------------------------- engine thread
    def features(self, item: MediaInput) -> torch.Tensor:
        """``[levels, image tokens, hidden]``: the image's features, from the encoder cache or the
        vision tower. Level 0 replaces the image tokens' embeddings; a model with more (Qwen3-VL's
        deepstack: features from inner layers of the vision tower) adds level i to the image
        tokens' hidden states after its language model's layer i - 1."""
        cached = self._cache.get(item.digest)
        data: ImageInputs = item.data
        if not data.looked_up:
            data.looked_up = True
            self.encoder_queries += 1
            self.encoder_hits += cached is not None
        if cached is not None:
            self._cache.move_to_end(item.digest)
            self.hits += 1
            return cached
        # A picture seen before comes without its pixel inputs: processed here, once more.
        tensors = data.tensors if data.tensors is not None else self._process(data.image, "image")[1]
        feats = self._tower(tensors)
        if feats.shape[1] != data.positions.numel():
            raise RuntimeError(f"the vision tower gave {feats.shape[1]} image tokens for {data.positions.numel()} "
                               "placeholders")
        self._keep(item, feats)
        return feats

    def _tower(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[levels, image tokens, hidden]`` of one vision-tower call (one picture or several)."""
        out = self.model.get_image_features(**{k: v.to(self.device) for k, v in tensors.items()}, return_dict=True)
        levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        return torch.stack([torch.cat([f.reshape(-1, f.shape[-1]) for f in level])
                            if isinstance(level, (list, tuple)) else level.reshape(-1, level.shape[-1])
                            for level in levels])

    def _keep(self, item: MediaInput, feats: torch.Tensor) -> None:
        """Count an encoded picture and keep its features in the encoder cache."""
        item.data.tensors = None  # the features are cached; the picture stays, should they be evicted
        self.encoded += 1
        self._cache[item.digest] = feats
        self._cache_bytes += feats.numel() * feats.element_size()
        while self._cache_bytes > ENCODER_CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.numel() * old.element_size()

    def encode_together(self, items: list[MediaInput]) -> dict[str, torch.Tensor]:
        """By digest, the features of those of ``items`` (a step's images) that the encoder cache
        lacks and whose pixel inputs join (``image_batch``): each group encoded in one call, and
        kept. The others are left to ``features``, one by one."""
        todo: dict[str, MediaInput] = {}
        for item in items:
            if item.digest not in self._cache and item.data.tensors is not None:
                todo.setdefault(item.digest, item)
        if len(todo) < 2:
            return {}
        pending = list(todo.values())
        out: dict[str, torch.Tensor] = {}
        for group in image_batch.groups([it.data.tensors for it in pending]):
            members = [pending[i] for i in group]
            joined = image_batch.join([it.data.tensors for it in members]) if len(members) > 1 else None
            if joined is None:
                continue
            feats = self._tower(joined)
            sizes = [it.data.positions.numel() for it in members]
            if feats.shape[1] != sum(sizes):  # not this family's way: one by one, in features()
                log.debug("joined images gave %d tokens for %d: encoding them apart", feats.shape[1], sum(sizes))
                continue
            for it, part in zip(members, feats.split(sizes, 1)):
                it.data.looked_up = True  # a query the cache missed
                self.encoder_queries += 1
                out[it.digest] = part = part.contiguous()
                self._keep(it, part)
        return out

    def eager(self, batch: list[StepItem]) -> bool:
        """Whether the step must run eagerly (no CUDA graph): it feeds an image's rows, or a
        sequence's positions are moved by its images (a multimodal RoPE after an image)."""
        return any(self.mrope or (m.start < it.start_pos + len(it.token_ids) and m.end > it.start_pos)
                   for it in batch for m in it.media)

    def embeddings(self, batch: list[StepItem], first_row: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the packed step in order, their image features ``[levels, rows, hidden]``) for
        every image token fed this step."""
        rows: list[torch.Tensor] = []
        wanted: list[tuple[MediaInput, torch.Tensor]] = []
        for it, row in zip(batch, first_row):
            lo, hi = it.start_pos, it.start_pos + len(it.token_ids)
            for item in it.media:
                if item.end <= lo or item.start >= hi:  # an earlier image (its shape moves later positions)
                    continue
                positions = item.data.positions
                inside = (positions >= lo) & (positions < hi)
                if not bool(inside.any()):
                    continue
                rows.append(positions[inside] - lo + row)
                wanted.append((item, inside))
        if not rows:
            return None
        fresh = self.encode_together([item for item, _ in wanted])  # new images of several requests, one call
        values: list[torch.Tensor] = []
        for item, inside in wanted:
            feats = fresh.get(item.digest)
            if feats is None:
                feats = self.features(item)
            elif not item.data.looked_up:  # the same picture in another request: the cache held it by then
                item.data.looked_up = True
                self.encoder_queries += 1
                self.encoder_hits += 1
                self.hits += 1
            values.append(feats[:, inside.to(self.device)])
        # In row order: decode rows are packed before prefill chunks, whatever the batch's order.
        at = torch.cat(rows).to(self.device)
        order = at.argsort()
        return at[order], torch.cat(values, 1)[:, order]


def runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive ``positions`` (sorted), as ``(first, last + 1)``."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return tuple(out)


def splice(h: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...] | None:
    """Put a step's image features (``VisionInputs.embeddings``) into its embeddings ``h`` in place
    of the image tokens'; returns (rows, the deeper levels ``[levels - 1, rows, hidden]``) for a
    model that adds those after its first layers (Qwen3-VL's deepstack), else None."""
    if images is None:
        return None
    rows, values = images
    h[rows] = values[0].to(h.dtype)
    return (rows, values[1:].to(h.dtype)) if values.shape[0] > 1 else None


def load_processor(model_dir: str, trust_remote_code: bool, tokenizer: Any, config: Any) -> Any:
    """The model's transformers processor around ``tokenizer`` (the server's, loaded once); where
    transformers cannot build it here, its family's image-only processor (``image_tokens.py``);
    else None (logged): the model then serves text only."""
    from transformers import AutoProcessor

    from .image_tokens import image_token_processor

    try:
        return AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
    except (OSError, ValueError, KeyError, ImportError, TypeError, AttributeError) as exc:
        # (A processor with a video half raises AttributeError without torchvision.)
        fallback = image_token_processor(model_dir, config, tokenizer, trust_remote_code)
        if fallback is None:
            log.warning("the image processor of %s cannot be loaded (%s): serving text only", model_dir, exc)
        return fallback


def is_vision_config(config: Any) -> bool:
    """Whether transformers loads this config as an image-text-to-text model with a vision tower."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "vision_config", None) is not None and (
        getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
