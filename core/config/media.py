"""``MediaConfig``: where images in requests may come from and how large they may be."""

from __future__ import annotations

from pydantic import Field

from llmserve.config.base import Section


class MediaConfig(Section):
    """Images in requests: the fetcher's rules (remote and local sources) and the caps on size,
    pixels and count. By default only inline images (``data:`` URLs, base64) are accepted."""

    allowed_media_domains: list[str] = Field(default_factory=list, description=(
        "Hosts that image URLs may name (exact names; *.example.com for its subdomains). Unset: no remote "
        "fetch, only data: URLs and base64 images. Each redirect is checked again."))
    allowed_media_networks: list[str] = Field(default_factory=list, description=(
        "Networks (CIDR) an allowed host may resolve to although they are not public, e.g. 10.0.0.0/8 for an "
        "image store on the local network. Unset: private, loopback, link-local, multicast and other "
        "non-public addresses are refused, whatever the host's name."))
    media_allow_http: bool = Field(False, description=(
        "Also fetch plain http:// image URLs from the allowed hosts (default: https only)."))
    allowed_local_media_path: str | None = Field(None, description=(
        "A folder that file:// image URLs may read from (after resolving links; a path outside it is refused). "
        "Unset: no local files."))
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description=(
        "Largest image accepted, in bytes, inline or fetched (a fetch stops reading there)."))
    max_image_pixels: int = Field(32 * 1024 * 1024, ge=1, description=(
        "Most pixels (width x height) an image may have; checked before it is decoded, so a decompression bomb "
        "costs nothing."))
    max_images_per_request: int = Field(8, ge=0, description="Most images one request may carry.")
    media_fetch_timeout: float = Field(10.0, gt=0, description=(
        "Seconds one image fetch may take in all (connecting, redirects, reading the body)."))
    media_max_redirects: int = Field(3, ge=0, le=20, description="Most redirects one image fetch follows.")
