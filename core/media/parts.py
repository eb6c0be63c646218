"""``ImagePart``: an image as a request carries it, whatever the dialect's shape.

Every dialect's request model turns its own form into one: OpenAI's ``image_url`` (a ``data:``
URL or an http(s) URL, with ``detail``), the Responses API's ``input_image``, Anthropic's
``image`` blocks (a base64 source or a url source), Ollama's ``images`` (base64 strings).
``param`` names the field, for the 400 that a bad image gets in the dialect's own format.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidRequestError

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass(slots=True)
class ImagePart:
    """One image: ``data`` (its bytes, for an inline image) or ``url`` (http, https or file: to
    fetch), ``mime`` when the request said, OpenAI's ``detail`` when given."""

    param: str
    data: bytes | None = None
    url: str | None = None
    mime: str | None = None
    detail: str | None = None


def image_from_base64(text: Any, param: str, max_bytes: int, mime: str | None = None) -> ImagePart:
    """An inline image given as base64 text (Anthropic's and Ollama's form); its size is checked
    before it is decoded."""
    if not isinstance(text, str) or not text:
        raise InvalidRequestError("an image must be a non-empty base64 string", param=param)
    compact = "".join(text.split())
    if len(compact) // 4 * 3 > max_bytes + 2:
        raise InvalidRequestError(f"the image is larger than --max-image-bytes ({max_bytes} bytes)", param=param)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image is not valid base64", param=param) from None
    if len(data) > max_bytes:
        raise InvalidRequestError(f"the image is larger than --max-image-bytes ({max_bytes} bytes)", param=param)
    return ImagePart(param=param, data=data, mime=mime)


DETAILS = (None, "auto", "low", "high")


def image_from_url(url: Any, param: str, max_bytes: int, detail: Any = None,
                   detail_param: str | None = None) -> ImagePart:
    """An image given by URL (OpenAI's ``image_url.url``, Anthropic's url source): a ``data:`` URL
    is decoded now; http, https and file URLs are kept for the fetcher, which applies the server's
    rules (``llmserve.media.fetch``). OpenAI's ``detail`` (field ``detail_param``, by default
    ``param.detail``) must be auto, low or high."""
    if detail not in DETAILS:
        where = detail_param or f"{param}.detail"
        raise InvalidRequestError(f"{where}: must be auto, low or high", param=where)
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequestError("an image URL must be a non-empty string", param=param)
    head = _DATA_URL.match(url)
    if head is not None:
        payload = url[head.end():]
        if not head.group("b64"):
            raise InvalidRequestError("a data: URL image must be base64 (data:image/png;base64,...)", param=param)
        part = image_from_base64(payload, param, max_bytes, mime=head.group("mime"))
        part.detail = detail
        return part
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https", "file"):
        raise InvalidRequestError("an image URL must be a data: URL, or an http(s) or file URL the server allows",
                                  param=param)
    return ImagePart(param=param, url=url.strip(), detail=detail)


def image_from_string(value: Any, param: str, max_bytes: int, paths: bool = False) -> ImagePart:
    """An image given as one string in any of the forms a dialect allows there (MindIE's
    ``image_url``, vLLM's ``multi_modal_data``): an http(s), ``file`` or ``data:`` URL; with
    ``paths``, an absolute path on the server (read under the same rules as a ``file`` URL); else
    bare base64."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{param}: must be a non-empty string (a URL or base64)", param=param)
    text = value.strip()
    if re.match(r"(https?|file|data):", text, re.IGNORECASE):
        return image_from_url(text, param, max_bytes)
    if paths and text.startswith("/"):
        return image_from_url("file://" + text, param, max_bytes)
    return image_from_base64(text, param, max_bytes)

