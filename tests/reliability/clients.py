"""Raw HTTP helpers for the reliability tests: requests whose connection the test drops."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

ECHO_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
PROMPT = "the quick brown fox jumps over the lazy dog " * 7  # echo: about 300 output tokens


def dechunk(raw: bytes) -> bytes:
    """The payload of a (possibly partial) chunked HTTP body."""
    out, rest = b"", raw
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def raw_request(path: str, body: Any, host: str = "127.0.0.1", close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n")
    return head.encode() + data


class Dropped:
    """A request sent on its own socket; ``close()`` is the client going away."""

    def __init__(self, url: str, path: str, body: Any) -> None:
        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname, parsed.port), timeout=30)
        self.sock.sendall(raw_request(path, body))

    def read_some(self, marker: bytes = b"\r\n\r\n", limit: float = 30.0) -> bytes:
        """Read until ``marker`` appears (for streams: the headers, then the first event)."""
        data = b""
        end = time.time() + limit
        while marker not in data:
            if time.time() > end:
                raise TimeoutError(f"no {marker!r} from the server; got {data[:300]!r}")
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    def read_for(self, seconds: float) -> bytes:
        """Everything the server sends in the next ``seconds``."""
        data = b""
        end = time.time() + seconds
        while (left := end - time.time()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
        self.sock.settimeout(30)
        return data

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def generation_routes(prompt: str = PROMPT, max_tokens: int = 150,
                      model: str = "echo") -> list[tuple[str, str, dict, bool]]:
    """(name, path, body, streams) for every generation route of every dialect."""
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if model == "echo":  # the echo model has no chat template (servers run --trust-request-chat-template)
        chat["chat_template"] = ECHO_TEMPLATE
    cmpl = {"prompt": prompt, "max_tokens": max_tokens}
    tgi = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}
    triton = {"text_input": prompt, "parameters": {"max_new_tokens": max_tokens}}
    return [
        ("openai-chat", "/v1/chat/completions", chat, False),
        ("openai-chat-stream", "/v1/chat/completions", {**chat, "stream": True}, True),
        ("openai-chat-n2", "/v1/chat/completions", {**chat, "n": 2, "temperature": 1.0}, False),
        ("openai-completions", "/v1/completions", cmpl, False),
        ("openai-completions-stream-n2", "/v1/completions", {**cmpl, "stream": True, "n": 2, "temperature": 1.0}, True),
        ("openai-completions-2-prompts", "/v1/completions", {**cmpl, "prompt": [prompt, prompt[::-1]]}, False),
        ("tgi-generate", "/generate", tgi, False),
        ("tgi-compat", "/", tgi, False),
        ("tgi-generate-stream", "/generate_stream", tgi, True),
        ("vllm-generate", "/generate", {**cmpl, "n": 2, "temperature": 1.0}, False),
        ("vllm-generate-stream", "/generate", {**cmpl, "stream": True}, True),
        ("mindie-infer", "/infer", {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}, False),
        ("mindie-infer-stream", "/infer", {"inputs": prompt, "stream": True,
                                           "parameters": {"max_new_tokens": max_tokens}}, True),
        ("triton-generate", f"/v2/models/{model}/generate", triton, False),
        ("triton-generate-stream", f"/v2/models/{model}/generate_stream", triton, True),
        ("triton-infer-2-texts", f"/v2/models/{model}/infer",
         {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": [prompt, prompt[::-1]]}],
          "parameters": {"max_new_tokens": max_tokens}}, False),
    ]
