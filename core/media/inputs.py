"""What a prompt's images become on their way to the model: ``MediaInput`` (one image's place in
the prompt's tokens, its content digest and the backend's processed form of it) and the
``MediaProcessor`` a backend that serves images hands the server in its ``ModelInfo``.

The core never looks inside ``MediaInput.data``: it carries it from the chat turn to the backend
with the sequence, hands each step the images its chunk covers, and mixes the digests into the
prefix cache's block hashes, so two prompts that differ only in an image never share KV.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One image of a prompt: its expansion fills token positions ``start .. end - 1`` (the
    model's placeholder tokens, and whatever markers its processor puts around them); ``digest``
    names its content (``image_digest``); ``data`` is the backend's processed form (pixels and
    whatever its vision tower takes), opaque to the core.

    ``bidirectional``: runs of positions ``(a, b)`` (``a .. b - 1``) whose tokens attend to each
    other both ways, a model whose image tokens see the whole image (Gemma 3): a token's keys then
    include later ones of its run, so the scheduler never ends a prefill chunk inside a run
    (``chunk_end``) and the backend's attention reads the runs from the step's images."""

    digest: str
    start: int
    end: int
    data: Any = field(default=None, compare=False, repr=False)
    bidirectional: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    def shifted(self, by: int) -> "MediaInput":
        """The same image ``by`` positions later (negative: earlier)."""
        return MediaInput(self.digest, self.start + by, self.end + by, self.data,
                          tuple((a + by, b + by) for a, b in self.bidirectional))


class MediaProcessor(Protocol):
    """How a backend that serves images turns a prompt's placeholders into its model's input.

    Set as ``ModelInfo.media``; the server calls it in a tokenizer thread (never on the event
    loop), after the chat template rendered one placeholder per image and the text was tokenized.
    """

    #: The placeholder the chat template's image parts render (its text, e.g. ``<image>``) and
    #: the token id it tokenizes to, one per image.
    placeholder: str
    placeholder_id: int

    # Optional counters the engine reports (``vllm:mm_cache_queries_total``, ``vllm:mm_cache_hits_total``)
    # when the backend keeps an encoder cache: ``encoder_queries`` (each request's images, at their
    # first lookup) and ``encoder_hits`` (those whose features the cache held).

    def expand(self, prompt_ids: list[int], images: Sequence[Any],
               param: str) -> tuple[list[int], tuple[MediaInput, ...]]:
        """``prompt_ids`` with each placeholder replaced by its image's expansion (``images``:
        decoded ``PIL.Image`` objects, in prompt order), and the images as ``MediaInput``s.
        A prompt whose placeholder count differs from the image count is an
        ``InvalidRequestError`` naming ``param``."""
        ...


def reads_images(info: Any) -> bool:
    """Whether the model a ``ModelInfo`` describes is served with its images."""
    return info is not None and info.media is not None and "image" in info.input_modalities


def image_digest(image: Any) -> str:
    """A digest of a decoded image's pixels and size (the same picture sent as PNG or as JPEG
    of the same pixels digests the same; any changed pixel changes it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def overlapping(media: Sequence[MediaInput], start: int, end: int) -> tuple[MediaInput, ...]:
    """The images whose expansion meets positions ``start .. end - 1``."""
    return tuple(m for m in media if m.start < end and m.end > start)


def started_before(media: Sequence[MediaInput], end: int) -> tuple[MediaInput, ...]:
    """The images whose expansion starts before position ``end``: those that fed positions up to
    ``end`` meet, and the earlier ones (whose shapes move a multimodal RoPE's later positions)."""
    return tuple(m for m in media if m.start < end)


def chunk_end(media: Sequence[MediaInput], start: int, end: int) -> int:
    """Where a prefill chunk from position ``start`` that would end before ``end`` (the step's token
    budget) ends so that it cuts no image run that attends both ways (``MediaInput.bidirectional``):
    before the run, or, for a chunk that starts inside it (after a prefix-cache hit within the
    image), past its end (over the budget by less than one image)."""
    for m in media:
        for a, b in m.bidirectional:
            if a < end < b:
                return a if a > start else b
    return end


def check_placeholders(ids: Sequence[int], media: Sequence[MediaInput], placeholder_id: int, param: str) -> None:
    """A 400 for a prompt holding the model's image placeholder token outside its images'
    expansions (typed into the text, or token ids from an earlier turn sent without its images):
    the model would read the placeholder's own embedding where it expects an image."""
    inside = sum(1 for m in media for t in ids[m.start:m.end] if t == placeholder_id)
    if sum(1 for t in ids if t == placeholder_id) != inside:
        from llmserve.errors import InvalidRequestError

        raise InvalidRequestError("the prompt holds the model's image placeholder token where no image was sent: "
                                  "attach the image (an image part of a message) instead of its placeholder",
                                  param=param)


def after_cut(media: Sequence[MediaInput], cut: int, why: str, param: str) -> tuple[MediaInput, ...]:
    """The images of a prompt whose first ``cut`` tokens were dropped (a truncation), where they now
    sit; a cut into an image is a 400 (``why``, naming ``param``): its features cannot be split
    from its placeholders."""
    if not cut or not media:
        return tuple(media)
    if media[0].start < cut:
        from llmserve.errors import InvalidRequestError

        raise InvalidRequestError(why, param=param)
    return tuple(m.shifted(-cut) for m in media)


def block_key(media: Sequence[MediaInput], index: int, block_size: int) -> bytes:
    """What a prefix-cache block's hash takes beside its tokens: the digests of the images in
    its positions (empty for a block of text alone)."""
    start = index * block_size
    return b"".join(m.digest.encode() for m in overlapping(media, start, start + block_size))
