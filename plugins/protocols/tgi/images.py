"""Images in TGI's ``inputs``: TGI's vision models take Markdown images (``![](URL)``, a
``data:`` URL or an http(s) URL) inside the prompt text. For a served model that reads images each
one becomes the model's own placeholder where it stood, and an image part the server fetches and
decodes under its media rules (docs/images.md); for a text-only model the text stays as it is."""

from __future__ import annotations

import re

from llmserve import ImagePart, image_from_url

_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)\s*\)")


def split_images(inputs: str, placeholder: str, max_bytes: int) -> tuple[str, list[ImagePart]]:
    """``inputs`` with each Markdown image replaced by ``placeholder``, and the images in order."""
    parts: list[ImagePart] = []

    def take(match: re.Match[str]) -> str:
        parts.append(image_from_url(match.group(1), f"inputs.images.{len(parts)}", max_bytes))
        return placeholder

    return _MARKDOWN_IMAGE.sub(take, inputs), parts

