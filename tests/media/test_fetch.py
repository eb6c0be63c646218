"""The image fetcher and decoder against real HTTP servers on loopback: what it fetches, what it
refuses (hosts, schemes, non-public addresses, redirects to them, long redirect chains), its
deadline against servers that drip, its byte cap against bodies that do not end, local files
under the allowed folder only, and images Pillow must refuse (bombs, truncated, not images)."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmserve.config.media import MediaConfig
from llmserve.errors import InvalidRequestError
from llmserve.media.fetch import Fetcher, _allowed_address
from llmserve.media.image import decode_image, load_images
from llmserve.media.parts import image_from_base64, image_from_url

PIL = pytest.importorskip("PIL.Image")


def png(width: int = 4, height: int = 3, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    PIL.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


IMAGE = png()


class Handler(BaseHTTPRequestHandler):
    """Paths: /img.png, /to?URL (302 there), /chain/N (302 to N+1), /drip (a body one byte per
    0.2 s), /drip-head (headers one byte per 0.2 s), /endless (an unending body, no length),
    /declared (a Content-Length over any cap)."""

    sent: dict[str, int] = {}

    def log_message(self, *args: object) -> None:
        return None

    def do_GET(self) -> None:
        route = next((fn for prefix, fn in ROUTES if self.path.startswith(prefix)), None)
        try:
            if route is None:
                self.send_error(404)
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher hung up: what several tests want

    def head(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()


def image(h: Handler) -> None:
    h.head(200, Content_Length=str(len(IMAGE)))
    h.wfile.write(IMAGE)


def redirect(h: Handler) -> None:
    h.head(302, Location=h.path[len("/to?"):])


def chain(h: Handler) -> None:
    n = int(h.path.rsplit("/", 1)[1])
    h.head(302, Location="/img.png" if n == 0 else f"/chain/{n - 1}")


def drip(h: Handler) -> None:
    if h.path == "/drip-open":  # no length: the body ends when the connection does
        h.head(200)
    else:
        h.head(200, Content_Length="400")
    for _ in range(400):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.2)


def drip_head(h: Handler) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 400:
        h.wfile.write(bytes([byte]))
        h.wfile.flush()
        time.sleep(0.2)


def endless(h: Handler) -> None:
    h.head(200)
    block = b"\0" * 65536
    Handler.sent["/endless"] = 0
    try:
        for _ in range(1600):  # 100 MiB unless the client stops reading
            h.wfile.write(block)
            Handler.sent["/endless"] += len(block)
    finally:
        ENDLESS_DONE.set()


def declared(h: Handler) -> None:
    h.head(200, Content_Length=str(10 ** 12))


ENDLESS_DONE = threading.Event()
ROUTES = [("/img.png", image), ("/to?", redirect), ("/chain/", chain), ("/drip-head", drip_head), ("/drip", drip),
          ("/endless", endless), ("/declared", declared)]


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def fetcher(**settings) -> Fetcher:
    base = {"allowed_media_domains": ["127.0.0.1", "localhost"], "media_allow_http": True,
            "allowed_media_networks": ["127.0.0.1/32"], "media_fetch_timeout": 5.0}
    return Fetcher(MediaConfig(**{**base, **settings}))


def refusal(f: Fetcher, url: str) -> str:
    with pytest.raises(InvalidRequestError) as err:
        f.fetch_remote(url, "messages.0.content.1.image_url")
    assert err.value.param == "messages.0.content.1.image_url"
    return str(err.value)


def test_an_allowed_host_is_fetched_and_redirects_within_the_rules_are_followed(server):
    assert fetcher().fetch_remote(server + "/img.png", "p") == IMAGE
    assert fetcher().fetch_remote(server + "/chain/2", "p") == IMAGE  # two hops, three allowed
    assert fetcher().fetch_remote(f"{server}/to?{server}/img.png", "p") == IMAGE


def test_hosts_schemes_and_non_public_addresses_are_refused(server):
    port = server.rsplit(":", 1)[1]
    assert "not in --allowed-media-domains" in refusal(fetcher(allowed_media_domains=["images.example"]),
                                                       server + "/img.png")
    assert "only https URLs are fetched" in refusal(fetcher(media_allow_http=False), server + "/img.png")
    # Loopback without --allowed-media-networks, by address and by a name resolving to it.
    strict = fetcher(allowed_media_networks=[])
    assert "resolves to 127.0.0.1, which is not a public address" in refusal(strict, server + "/img.png")
    assert "not a public address" in refusal(strict, f"http://localhost:{port}/img.png")
    # IPv6 forms that carry a loopback IPv4 address (mapped, 6to4) are judged by that address; a
    # machine without IPv6 refuses the URL at resolution instead, which is a refusal too.
    assert not any(_allowed_address(ipaddress.ip_address(a), []) for a in ("::ffff:127.0.0.1", "2002:7f00:1::"))
    assert _allowed_address(ipaddress.ip_address("::ffff:127.0.0.1"), [ipaddress.ip_network("127.0.0.1/32")])
    mapped = fetcher(allowed_media_networks=[], allowed_media_domains=["::ffff:127.0.0.1"])
    refusal(mapped, f"http://[::ffff:127.0.0.1]:{port}/img.png")  # refused, whichever way


@pytest.mark.parametrize("target", ["http://127.0.0.2:{port}/img.png", "http://169.254.169.254/latest/meta-data/",
                                    "http://10.1.2.3/img.png", "http://100.64.0.1/img.png",
                                    "http://images.example/img.png", "file:///etc/passwd"])
def test_a_redirect_is_checked_like_the_first_url(server, target):
    port = server.rsplit(":", 1)[1]
    domains = ["127.0.0.1", "127.0.0.2", "169.254.169.254", "10.1.2.3", "100.64.0.1"]
    line = refusal(fetcher(allowed_media_domains=domains), f"{server}/to?{target.format(port=port)}")
    assert "refused" in line, line


def test_a_chain_of_ten_redirects_is_refused(server):
    assert "redirects more than --media-max-redirects (3) times" in refusal(fetcher(), server + "/chain/10")


@pytest.mark.parametrize("path", ["/drip", "/drip-open", "/drip-head"])
def test_a_server_that_drips_hits_the_deadline(server, path):
    assert "took longer than 1 s" in refusal(fetcher(media_fetch_timeout=1.0), server + path)


def test_a_body_over_the_cap_stops_the_read(server):
    cap = 1024 * 1024
    assert f"larger than --max-image-bytes ({cap} bytes)" in refusal(fetcher(max_image_bytes=cap), server + "/endless")
    assert "larger than --max-image-bytes" in refusal(fetcher(max_image_bytes=cap), server + "/declared")
    assert ENDLESS_DONE.wait(60)  # the server's writes fail once the fetcher has hung up
    assert Handler.sent["/endless"] < 100 * 2 ** 20


def test_cancelling_the_request_aborts_the_fetch(server):
    async def go() -> None:
        part = image_from_url(server + "/drip", "p", 1 << 20)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fetcher(media_fetch_timeout=60.0).fetch_image(part), 0.5)

    asyncio.run(go())


def test_local_files_only_under_the_allowed_folder(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(IMAGE)
    (outside / "b.png").write_bytes(IMAGE)
    os.symlink(outside / "b.png", inside / "link.png")
    f = fetcher(allowed_local_media_path=str(inside))
    assert f.read_local(f"file://{inside}/a.png", "p") == IMAGE
    for url in (f"file://{outside}/b.png", f"file://{inside}/link.png", f"file://{inside}/../secret/b.png"):
        with pytest.raises(InvalidRequestError, match="outside --allowed-local-media-path"):
            f.read_local(url, "p")
    with pytest.raises(InvalidRequestError, match="no --allowed-local-media-path"):
        fetcher().read_local(f"file://{inside}/a.png", "p")
    with pytest.raises(InvalidRequestError, match="larger than --max-image-bytes"):
        fetcher(allowed_local_media_path=str(inside), max_image_bytes=10).read_local(f"file://{inside}/a.png", "p")


def test_inline_images_and_their_caps():
    data = base64.b64encode(IMAGE).decode()
    part = image_from_url(f"data:image/png;base64,{data}", "p", 1 << 20, detail="low")
    assert (part.data, part.mime, part.detail) == (IMAGE, "image/png", "low")
    assert image_from_base64(data, "p", 1 << 20).data == IMAGE
    with pytest.raises(InvalidRequestError, match="larger than --max-image-bytes"):
        image_from_base64(data, "p", 10)
    with pytest.raises(InvalidRequestError, match="not valid base64"):
        image_from_base64("not*base64", "p", 1 << 20)
    with pytest.raises(InvalidRequestError, match="must be base64"):
        image_from_url("data:image/png,rawbytes", "p", 1 << 20)
    with pytest.raises(InvalidRequestError, match="data: URL, or an http"):
        image_from_url("ftp://host/a.png", "p", 1 << 20)
    assert image_from_url("https://images.example/a.png", "p", 1).url == "https://images.example/a.png"


def with_size(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (its CRC fixed), its pixel data left as it is."""
    ihdr = data.index(b"IHDR")
    fields = struct.pack(">II", width, height) + data[ihdr + 12: ihdr + 17]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + fields) & 0xFFFFFFFF)
    return data[:ihdr + 4] + fields + crc + data[ihdr + 21:]


def test_the_decoder_refuses_bombs_truncated_files_and_non_images():
    image = decode_image(png(5, 7), "p", max_pixels=100)
    assert image.size == (5, 7) and image.mode == "RGB"
    with pytest.raises(InvalidRequestError, match="more than --max-image-pixels"):
        decode_image(with_size(IMAGE, 100000, 100000), "p", max_pixels=32 * 2 ** 20)
    with pytest.raises(InvalidRequestError, match="6x6 pixels, more than --max-image-pixels \\(30\\)"):
        decode_image(png(6, 6), "p", max_pixels=30)
    big = png(300, 300)
    with pytest.raises(InvalidRequestError, match="truncated or corrupt"):
        decode_image(big[: len(big) // 2], "p", max_pixels=10 ** 6)
    with pytest.raises(InvalidRequestError, match="not in a format the server reads"):
        decode_image(b"GIF89a-but-not-really" * 3, "p", max_pixels=10 ** 6)


def test_a_requests_images_are_loaded_in_order_under_the_count_cap(server, tmp_path):
    """Inline, fetched and local images of one request, decoded in the order given; one image
    more than --max-images-per-request is a 400 naming the first one over."""
    (tmp_path / "blue.png").write_bytes(png(2, 2, (0, 0, 255)))
    config = fetcher(allowed_local_media_path=str(tmp_path), max_images_per_request=3).config
    green = base64.b64encode(png(3, 1, (0, 255, 0))).decode()
    parts = [image_from_url(f"data:image/png;base64,{green}", "m.0", 1 << 20),
             image_from_url(server + "/img.png", "m.1", 1 << 20),
             image_from_url(f"file://{tmp_path}/blue.png", "m.2", 1)]
    images = asyncio.run(load_images(parts, config))
    assert [(im.size, im.getpixel((0, 0))) for im in images] == [((3, 1), (0, 255, 0)), ((4, 3), (200, 10, 10)),
                                                                 ((2, 2), (0, 0, 255))]
    with pytest.raises(InvalidRequestError, match="4 images, more than --max-images-per-request \\(3\\)") as err:
        asyncio.run(load_images([*parts, parts[0]], config))
    assert err.value.param == "m.0"
