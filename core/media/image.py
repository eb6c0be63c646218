"""Decoding an image with Pillow under the server's caps: the pixel count is read from the
header and checked before any pixel is decoded (a decompression bomb costs nothing), and a
file Pillow cannot read, or a truncated one, is a 400 naming the request's field."""

from __future__ import annotations

import asyncio
import io
import warnings
from typing import TYPE_CHECKING, Any

from llmserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from llmserve.config.media import MediaConfig
    from llmserve.media.fetch import Fetcher
    from llmserve.media.parts import ImagePart


async def load_images(parts: "list[ImagePart]", config: "MediaConfig", fetcher: "Fetcher | None" = None) -> list[Any]:
    """A request's images, decoded: at most ``--max-images-per-request`` of them, fetched under
    the server's rules (concurrently), then decoded on a worker thread, in order."""
    from llmserve.media.fetch import Fetcher

    cap = config.max_images_per_request
    if len(parts) > cap:
        raise InvalidRequestError(f"the request has {len(parts)} images, more than --max-images-per-request ({cap})",
                                  param=parts[cap].param)
    fetcher = fetcher or Fetcher(config)
    blobs = await asyncio.gather(*(fetcher.fetch_image(part) for part in parts))
    return await asyncio.to_thread(
        lambda: [decode_image(blob, part.param, config.max_image_pixels) for blob, part in zip(blobs, parts)])


def decode_image(data: bytes, param: str, max_pixels: int) -> Any:
    """``data`` as an RGB ``PIL.Image.Image`` (the first frame of an animation)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequestError(f"the image has {width}x{height} pixels, more than --max-image-pixels "
                                          f"({max_pixels})", param=param)
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        raise InvalidRequestError("the image is not in a format the server reads (PNG, JPEG, GIF, WebP, BMP, ...)",
                                  param=param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(f"the image decompresses to more than --max-image-pixels ({max_pixels})",
                                  param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequestError(f"the image is truncated or corrupt ({exc})", param=param) from None
