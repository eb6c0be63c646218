"""Bringing an image in from a URL, safely: the server fetches only what its settings allow.

Remote (http, https) images come only from ``--allowed-media-domains``, over https unless
``--media-allow-http``. The host is resolved once and every address it resolves to must be
public (or inside ``--allowed-media-networks``): loopback, private, link-local (cloud metadata),
carrier-grade NAT, multicast, reserved and IPv4-mapped or tunnelled forms of them are refused.
The connection goes to the validated address (TLS still checks the certificate against the
name), so a second lookup cannot swap it (DNS rebinding). Redirects are followed by hand, each
target checked like the first, at most ``--media-max-redirects``. One deadline covers the whole
fetch (a watchdog shuts the socket when it passes, so a server that drips its headers or body
cannot hold a thread), and the body is read only up to ``--max-image-bytes``.

Local (file) images come only from under ``--allowed-local-media-path``, after resolving links.

Fetches run on a worker thread (``fetch_image`` awaits it); when the request is cancelled the
fetch is aborted. Every refusal is an ``InvalidRequestError`` naming the request's field.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import os
import socket
import ssl
import threading
from typing import Any
from urllib.parse import urljoin, urlsplit
from urllib.request import url2pathname

from llmserve.config.media import MediaConfig
from llmserve.errors import InvalidRequestError
from llmserve.media.parts import ImagePart

REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 64 * 1024
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class _Abort:
    """The fetch's deadline and cancellation: shuts the socket in use, so a blocked read returns."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reason: str | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self.abort, args=(f"took longer than {seconds:g} s",))
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def use(self, sock: socket.socket | None) -> None:
        """Watch ``sock`` (the connection's socket: a response may hold it after the connection
        let go of it); shut it at once when the fetch was already aborted."""
        with self._lock:
            self._sock = sock
        if sock is not None and self.reason is not None:
            self._shut(sock)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            sock = self._sock
        if sock is not None:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def stop(self) -> None:
        self._timer.cancel()


def _allowed_address(ip: IPAddress, networks: list[Any]) -> bool:
    if any(ip in net for net in networks):
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is not None:
            return _allowed_address(inner, networks)
    return ip.is_global and not ip.is_multicast


def _host_allowed(host: str, domains: list[str]) -> bool:
    host = host.rstrip(".").lower()
    for domain in domains:
        domain = domain.strip().rstrip(".").lower()
        if host == domain or (domain.startswith("*.") and host.endswith(domain[1:])):
            return True
    return False


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to ``ip`` for the host named in the URL (no lookup of its own)."""

    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """As ``_PinnedHTTP`` over TLS; the certificate is checked against the URL's host name."""

    def __init__(self, host: str, port: int, ip: str, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.ip = ip
        self.tls = context

    def connect(self) -> None:
        sock = socket.create_connection((self.ip, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host)


class Fetcher:
    """The server's image fetcher, built from its ``MediaConfig``."""

    def __init__(self, config: MediaConfig, tls: ssl.SSLContext | None = None) -> None:
        self.config = config
        self.networks = [ipaddress.ip_network(n, strict=False) for n in config.allowed_media_networks]
        self.tls = tls or ssl.create_default_context()

    async def fetch_image(self, part: ImagePart) -> bytes:
        """``part``'s bytes: inline data as it is, else fetched on a worker thread (aborted when
        the awaiting request is cancelled)."""
        if part.data is not None:
            return part.data
        assert part.url is not None
        if part.url.lower().startswith("file:"):
            return await asyncio.to_thread(self.read_local, part.url, part.param)
        abort = _Abort(self.config.media_fetch_timeout)
        try:
            return await asyncio.to_thread(self.fetch_remote, part.url, part.param, abort)
        except asyncio.CancelledError:
            abort.abort("the request was cancelled")
            raise

    # -- local files ------------------------------------------------------------------------------
    def read_local(self, url: str, param: str) -> bytes:
        root = self.config.allowed_local_media_path
        if not root:
            raise InvalidRequestError("file URLs are not allowed: the server has no --allowed-local-media-path",
                                      param=param)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequestError("a file URL must name a local path (file:///...)", param=param)
        path = os.path.realpath(url2pathname(parts.path))
        base = os.path.realpath(root)
        if os.path.commonpath([path, base]) != base:
            raise InvalidRequestError("the file is outside --allowed-local-media-path", param=param)
        cap = self.config.max_image_bytes
        try:
            if not os.path.isfile(path):
                raise InvalidRequestError("no such image file under --allowed-local-media-path", param=param)
            if os.path.getsize(path) > cap:
                raise InvalidRequestError(f"the image is larger than --max-image-bytes ({cap} bytes)", param=param)
            with open(path, "rb") as fh:
                return fh.read(cap + 1)
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the image file ({exc.strerror or exc})", param=param) from None

    # -- remote URLs ------------------------------------------------------------------------------
    def fetch_remote(self, url: str, param: str, abort: _Abort | None = None) -> bytes:
        """The body of ``url`` (following allowed redirects), or an ``InvalidRequestError``."""
        abort = abort or _Abort(self.config.media_fetch_timeout)
        abort.start()
        try:
            for _ in range(self.config.media_max_redirects + 1):
                conn, target = self._connect(url, param)
                try:
                    conn.connect()
                    abort.use(conn.sock)
                    location, body = self._get(conn, target, param, abort)
                    if location is None:
                        return body
                finally:
                    abort.use(None)
                    conn.close()
                url = urljoin(url, location)
            raise InvalidRequestError(f"the image URL redirects more than --media-max-redirects "
                                      f"({self.config.media_max_redirects}) times", param=param)
        except (OSError, http.client.HTTPException) as exc:
            reason = abort.reason or str(exc) or type(exc).__name__
            raise InvalidRequestError(f"cannot fetch the image: {reason}", param=param) from None
        finally:
            abort.stop()

    def _connect(self, url: str, param: str) -> tuple[http.client.HTTPConnection, str]:
        """A connection to ``url``'s validated address, and the request target to send."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise InvalidRequestError("the image URL is malformed", param=param) from None
        scheme, host = parts.scheme.lower(), parts.hostname or ""
        if scheme not in ("http", "https") or (scheme == "http" and not self.config.media_allow_http):
            allowed = "https URLs" + (" and http URLs" if self.config.media_allow_http else "")
            raise InvalidRequestError(f"image URL refused: only {allowed} are fetched (got {scheme or 'none'})",
                                      param=param)
        if not host or not _host_allowed(host, self.config.allowed_media_domains):
            shown = host or "(none)"
            raise InvalidRequestError(f"image URL refused: the host {shown} is not in --allowed-media-domains",
                                      param=param)
        port = port or (443 if scheme == "https" else 80)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise InvalidRequestError(f"cannot fetch the image: the host {host} does not resolve",
                                      param=param) from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        refused = next((a for a in addresses if not _allowed_address(a, self.networks)), None)
        if refused is not None or not addresses:
            raise InvalidRequestError(f"image URL refused: {host} resolves to {refused}, which is not a public "
                                      "address (--allowed-media-networks allows others)", param=param)
        ip, timeout = str(addresses[0]), self.config.media_fetch_timeout
        conn: http.client.HTTPConnection = (_PinnedHTTPS(host, port, ip, timeout, self.tls) if scheme == "https"
                                            else _PinnedHTTP(host, port, ip, timeout))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return conn, target

    def _get(self, conn: http.client.HTTPConnection, target: str, param: str,
             abort: _Abort) -> tuple[str | None, bytes]:
        """Send the GET: (a redirect's ``Location``, b"") or (None, the body)."""
        conn.request("GET", target, headers={"User-Agent": "llmserve", "Accept": "image/*"})
        resp = conn.getresponse()
        try:
            return self._read(resp, param, abort)
        finally:
            resp.close()  # the socket itself: a response without a length holds it, not the connection

    def _read(self, resp: http.client.HTTPResponse, param: str, abort: _Abort) -> tuple[str | None, bytes]:
        if resp.status in REDIRECTS:
            location = resp.getheader("Location")
            if not location:
                raise InvalidRequestError(f"cannot fetch the image: HTTP {resp.status} without a Location",
                                          param=param)
            return location, b""
        if resp.status != 200:
            raise InvalidRequestError(f"cannot fetch the image: HTTP {resp.status}", param=param)
        cap = self.config.max_image_bytes
        too_big = InvalidRequestError(f"the image is larger than --max-image-bytes ({cap} bytes)", param=param)
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise too_big
        chunks, total = [], 0
        while True:
            chunk = resp.read1(CHUNK)
            if abort.reason is not None:
                raise OSError(abort.reason)
            if not chunk:
                break
            total += len(chunk)
            if total > cap:
                raise too_big
            chunks.append(chunk)
        return None, b"".join(chunks)
