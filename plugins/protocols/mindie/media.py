"""MindIE's multimodal ``inputs``: a list of ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": ...}`` items, read as one user message of the model's chat
template with its images in place (MindIE renders a multimodal list through the model's own
template). An ``image_url`` is an http(s) or ``file://`` URL, a ``data:`` URL, a path on the
server (an absolute one: the server's ``--allowed-local-media-path`` rules apply), or bare base64
(MindIE's own form for an inline picture)."""

from __future__ import annotations

from typing import Any

from llmserve import ImagePart, InvalidRequestError, image_from_string

# "The total number of image_url, video_url and audio_url in a single request should be <= 20."
MAX_MEDIA = 20


def multimodal_turn(inputs: list[Any], max_bytes: int) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """(the user message's content parts, with ``{"type": "image"}`` where each image was; the
    images) of a multimodal ``inputs`` list; a malformed item is a 422 naming it."""
    if not inputs:
        raise InvalidRequestError("inputs: must not be empty", param="inputs")
    content: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    for i, item in enumerate(inputs):
        param = f"inputs.{i}"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            text = item.get("text")
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"{param}.text: must be a non-empty string", param=f"{param}.text")
            content.append({"type": "text", "text": text})
        elif kind == "image_url":
            images.append(image_from_string(item.get("image_url"), f"{param}.image_url", max_bytes, paths=True))
            content.append({"type": "image"})
        elif kind in ("video_url", "audio_url"):
            raise InvalidRequestError(f"{param}: {kind} inputs are not supported by this server (images are)",
                                      param=param)
        else:
            raise InvalidRequestError(f"{param}: each item must be an object whose type is text or image_url",
                                      param=param)
        if len(images) > MAX_MEDIA:
            raise InvalidRequestError(f"inputs: more than {MAX_MEDIA} images", param=param)
    if not images and not any(c["type"] == "text" for c in content):
        raise InvalidRequestError("inputs: must hold text or an image", param="inputs")
    return content, images
