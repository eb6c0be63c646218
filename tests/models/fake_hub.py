"""A fake Hugging Face Hub on loopback for the model-resolution tests: a real threaded HTTP server
speaking the routes huggingface_hub 2.x uses, reached through ``HF_ENDPOINT``.

- ``GET /api/models/{org}/{name}[/revision/{rev}]``: the model info (``sha``, ``siblings`` with
  sizes, ``gated``), 404 ``RepoNotFound`` / ``RevisionNotFound`` as the Hub answers them;
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: a file, with ``X-Repo-Commit``, ``ETag``,
  ``Content-Length`` and ``Accept-Ranges``; ``Range: bytes=N-`` answers 206; a gated repo answers
  401 ``GatedRepo`` without a token and 403 ``GatedRepo`` to a token not granted access; a file in
  ``missing`` is listed by the repo but answers 404 ``EntryNotFound``.

``cut_once`` names files whose first GET stops halfway (the connection closed mid-body), to
test resuming; ``requests`` records (method, path, Range header) of every request, ``tokens``
the ``Authorization`` header each sent (None: none).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

GOOD_TOKEN = "hf_good_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    tokens: list[str | None] = field(default_factory=list)
    chunk_delay: float = 0.0  # seconds between 4 kB chunks of a file body (slow downloads)
    url: str = ""

    def add(self, repo: str, files: dict[str, bytes], gated: bool = False) -> str:
        sha = hashlib.sha1((repo + "".join(sorted(files))).encode() + b"".join(files.values())).hexdigest()
        self.repos[repo] = Repo(dict(files), sha, gated)
        return sha

    def gets(self, suffix: str = "") -> list[str]:
        """Paths of the file GETs so far (ending in ``suffix``)."""
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)]

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def do_GET(self) -> None:
                hub.handle(self, "GET")

            def do_HEAD(self) -> None:
                hub.handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- routes ---------------------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((method, path, h.headers.get("Range")))
        self.tokens.append(h.headers.get("Authorization"))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if api and method == "GET":
            return self.info(h, api.group(1), api.group(2))
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve:
            return self.file(h, method, *resolve.groups())
        self.error(h, 404, "EntryNotFound", "no such route")

    def error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _repo(self, h: BaseHTTPRequestHandler, name: str, revision: str | None) -> Repo | None:
        repo = self.repos.get(name)
        if repo is None:
            self.error(h, 404, "RepoNotFound", f"Repository {name} not found")
            return None
        if revision not in (None, "main", repo.sha):
            self.error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def info(self, h: BaseHTTPRequestHandler, name: str, revision: str | None) -> None:
        repo = self._repo(h, name, revision)
        if repo is None:
            return
        body = json.dumps({"id": name, "modelId": name, "sha": repo.sha, "private": False,
                           "gated": "manual" if repo.gated else False,
                           "siblings": [{"rfilename": f, "size": len(b)} for f, b in repo.files.items()]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def file(self, h: BaseHTTPRequestHandler, method: str, name: str, revision: str, fname: str) -> None:
        repo = self._repo(h, name, revision)
        if repo is None:
            return
        token = h.headers.get("Authorization")
        if repo.gated and token != f"Bearer {GOOD_TOKEN}":
            return self.error(h, 403 if token else 401, "GatedRepo", f"Access to model {name} is restricted.")
        data = repo.files.get(fname)
        if data is None or fname in self.missing:
            return self.error(h, 404, "EntryNotFound", f"{fname} does not exist")
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or "")
        if ranged and method == "GET":
            start = int(ranged.group(1))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if method == "HEAD":
            return
        body = data[start:]
        if fname in self.cut_once and not start:
            self.cut_once.discard(fname)
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the peer sees the body end early
            return
        self._send(h, body)

    def _send(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        import time

        step = 4096 if self.chunk_delay else 64 * 1024
        for i in range(0, len(body), step):
            h.wfile.write(body[i:i + step])
            if self.chunk_delay:
                h.wfile.flush()
                time.sleep(self.chunk_delay)
