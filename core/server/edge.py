"""The HTTP edge: connection-level limits that uvicorn's httptools protocol does not have.

uvicorn reads a request's line and headers whole, however large, before the app (and so the
API-key check) sees anything, and it puts no time limit on a connection that has not finished
sending them. ``edge_protocol(config)`` builds the HTTP protocol class the server runs with,
uvicorn's own with these bounds added:

- **head size**: the request line and headers together may not exceed ``--max-header-bytes``
  (431; 414 when the URL alone is too long), nor count more than ``--max-header-count`` headers
  (431). The check runs on every chunk read from the socket, before the next one is read, so a
  100 MiB header costs one socket read of memory, not 100 MiB;
- **head time**: a connection must finish sending a request's line and headers within
  ``--timeout-request-headers`` seconds of opening (or of the request's first byte on a
  keep-alive connection); a silent or trickling client is then disconnected (408 when part of a
  request had arrived). Idle keep-alive connections stay governed by ``--timeout-keep-alive``;
- **early answers**: when a response is complete before its request body has been read (413,
  401 and other refusals), the server keeps reading and discarding the rest of the body, for up
  to ``--timeout-request-headers`` seconds, so that the client, which usually sends its whole
  body before it reads, receives the answer instead of a connection reset. Nothing is kept.

The refusals close the connection. They come before the route runs, but the request line's
target names it: the body is the error format of the dialect that owns the path
(``middleware.head_refusals``), so that a client reads it as it reads the route's other errors;
without a known path it is the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from llmserve.config import ServerConfig

_REASONS = {408: b"Request Timeout", 414: b"URI Too Long", 431: b"Request Header Fields Too Large"}


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a request head past its limits."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounded request heads and discard-after-answer."""

    max_header_bytes = 65536
    max_header_count = 256
    timeout_request_headers = 30.0
    #: ``(method, target, status, message) -> (content type, body)`` of a refusal; None: plain text.
    answer: Callable[[str, bytes, int, str], tuple[bytes, bytes]] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True     # waiting for (the rest of) a request's line and headers
        self._head_bytes = 0       # bytes read while the head was open
        self._head_started = False  # some byte of the current head has arrived
        self._header_count = 0
        self._dropping = False     # refused: everything read from now on is dropped
        self._events = 0           # request heads and bodies that ended on this connection
        self._head_timer: asyncio.TimerHandle | None = None
        self._discard_timer: asyncio.TimerHandle | None = None

    # -- connection ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends anything is bounded too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return  # after a refusal: read only so that the client can read the answer
        self._unset_keepalive_if_required()
        events = self._events
        if self._head_open:
            self._head_started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, _HeadRefused):
                self._refuse(refused.status, refused.message)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        # Bytes count against the head only if no head or body ended in this chunk (such a chunk
        # also holds body bytes, which are not head).
        if self._head_open and events == self._events and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(431, f"request line and headers exceed {self.max_header_bytes} bytes "
                                  "(--max-header-bytes)")

    # -- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_started = True
        self._header_count = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.max_header_bytes:
            raise _HeadRefused(414, f"the URL exceeds {self.max_header_bytes} bytes (--max-header-bytes)")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_header_count:
            raise _HeadRefused(431, f"more than {self.max_header_count} request headers (--max-header-count)")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:
            raise _HeadRefused(431, f"request line and headers exceed {self.max_header_bytes} bytes "
                                    "(--max-header-bytes)")
        self._head_open = False
        self._events += 1
        self._head_bytes = 0
        self._head_started = False
        self._cancel(self._head_timer)
        self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True
        self._head_bytes = 0
        self._events += 1
        if self.cycle is not None and self.cycle.response_complete and self._discard_timer is not None:
            # The body of an early answer has been read and dropped: the connection is an idle
            # keep-alive one again (reading it cancelled uvicorn's idle timer).
            self._cancel(self._discard_timer)
            self._discard_timer = None
            if not self.transport.is_closing() and not self.pipeline:
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            # Answered before the body was read: uvicorn drops what still arrives (on_body
            # ignores a request whose response is complete); bound how long that may go on.
            self._discard_timer = self.loop.call_later(self.timeout_request_headers, self._close)

    # -- helpers -------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._cancel(self._head_timer)
        self._head_timer = self.loop.call_later(self.timeout_request_headers, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_open:
            return
        if self._head_started:
            self._refuse(408, f"the request's line and headers did not arrive within {self.timeout_request_headers:g} "
                              "s (--timeout-request-headers)")
        else:
            self._close()  # never said anything: nothing to answer

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` in plain text before any route has seen the request, then close.

        Closing a socket with unread data makes the kernel send a reset, which can destroy the
        answer before the client reads it; a client typically sends its whole request before it
        reads. So the answer goes out with our end shut for writing, and what the client still
        sends is read and dropped until it closes, or for ``timeout_request_headers`` at most.
        """
        self._cancel_timers()
        self.logger.warning("refused a request head: %s", message)
        if self.cycle is not None and not self.cycle.response_complete:
            self._close()  # a pipelined head while a response is under way: no room for an answer
            return
        media, body = b"text/plain; charset=utf-8", message.encode("ascii", "replace")
        target = getattr(self, "url", b"")  # what arrived of the request's target (set once a request began)
        if self.answer is not None:
            # The method is parsed before the target: with a target, it is known.
            method = self.parser.get_method().decode("latin-1") if target else ""
            media, body = self.answer(method, target, status, message)
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], media, len(body), body))
        self._dropping = True
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._discard_timer = self.loop.call_later(self.timeout_request_headers, self._close)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _cancel_timers(self) -> None:
        self._cancel(self._head_timer)
        self._cancel(self._discard_timer)
        self._head_timer = self._discard_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def edge_protocol(config: "ServerConfig",
                  answer: Callable[[str, bytes, int, str], tuple[bytes, bytes]] | None = None) -> type[EdgeProtocol]:
    """The HTTP protocol class for a server with ``config``'s limits; ``answer`` renders its refusals
    (``middleware.head_refusals``), plain text without it."""
    return type("EdgeProtocol", (EdgeProtocol,), {
        "max_header_bytes": int(config.http.max_header_bytes),
        "max_header_count": int(config.http.max_header_count),
        "timeout_request_headers": float(config.http.timeout_request_headers),
        "answer": staticmethod(answer) if answer is not None else None,
    })
