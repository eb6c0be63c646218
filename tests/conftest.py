"""Shared fixtures: offline mode, the echo-backend server, a uvicorn runner on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ContextManager, Iterator

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when Triton and
# its standard library are first imported (torch may do that early), so it is set before anything.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs two workers on the CI's two cores) each worker and the servers
# it starts compute on one thread: two workers of two threads each on two cores make every kernel's
# barrier wait for a descheduled thread, slower than one worker alone. The kernels' split over
# threads is held to the single-threaded result by tests/backends/test_kernel_threads.py.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
ECHO_PLUGIN = str(ROOT / "tests" / "plugins" / "echo_backend.py")
EXAMPLE_PLUGIN = ROOT / "examples" / "llmserve-acme"


def _ports() -> Iterator[int]:
    """Under xdist, a range of ports per worker, below the kernel's ephemeral range: a port
    another worker was handed cannot be handed out again before its server binds it."""
    base = 20000 + 1000 * int(WORKER.removeprefix("gw"))
    while True:
        yield from range(base, base + 1000)


_WORKER_PORTS = _ports() if WORKER.removeprefix("gw").isdigit() else None


def free_port() -> int:
    """A loopback port nothing listens on now."""
    for _ in range(1000 if _WORKER_PORTS else 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", next(_WORKER_PORTS) if _WORKER_PORTS else 0))
            except OSError:  # taken, or closing (TIME_WAIT): the next one
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port in this worker's range")


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m llmserve ARGS`` in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


class ServerProcess:
    """``llmserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **(env or {})}
        if "--timeout-keep-alive" not in args:
            # Test clients pool connections and most run with max_retries=0. With the 5 s
            # default, a connection left idle by one burst can be reused by the next just as
            # the server closes it: a client-side reset (ECONNRESET) that says nothing about
            # the server. Idle connections outlive every test instead.
            args = (*args, "--timeout-keep-alive", "600")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                     cwd=ROOT)
        # Drain the log as it comes: a server whose pipe fills (64 KiB: a few hundred request
        # lines) blocks in its next log call, and every request it serves then hangs.
        self._log: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.append(line)

    @property
    def log(self) -> str:
        """What the server has written so far (stdout and stderr)."""
        return "".join(self._log)

    def wait_ready(self, timeout: float = 120) -> "ServerProcess":
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log}")
            try:
                # /ready, not /health: the server answers /health while its model still loads
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("server did not become ready")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reader.join(timeout=5)
        return self.log


@contextmanager
def serving(*args: str, timeout: float = 120, clean_log: bool = False) -> Iterator[ServerProcess]:
    """A ``ServerProcess`` of ``args``, ready, for the ``with`` block, and stopped after it (also
    when it does not get ready); with ``clean_log``, its log must then hold no traceback."""
    server = ServerProcess(*args)
    try:
        yield server.wait_ready(timeout)
    finally:
        log = server.stop()
        if clean_log:
            assert "Traceback" not in log, log


# What the embedding tests of the dialects send to embed_server's model.
EMBED_TEXTS = ["The capital of France is Paris.", "Bananas are yellow and grow in bunches."]


def embed_server(protocols: str) -> ContextManager[ServerProcess]:
    """``serving`` the embedded all-MiniLM-L6-v2 (``--task embed``) as ``mini``, strict model
    names (an unknown one is a 404), on the dialects ``protocols``."""
    return serving("--task", "embed", "--served-model-name", "mini", "--protocols", protocols, "--strict-model-name",
                   "--log-level", "warning", timeout=180)


@pytest.fixture
def server_process():
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(*args, env=env)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def echo_app():
    """An in-process app on the echo backend (no model load), with every built-in protocol."""
    from fastapi.testclient import TestClient

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.server.serve import build_server

    def make(**flags):
        flags.setdefault("backend", "echo")
        flags.setdefault("plugins", [ECHO_PLUGIN])
        config, _ = load_config(flags, environ={})
        app, context = build_server(config, PluginManager().load(autoload=False))
        return TestClient(app, raise_server_exceptions=False), context

    clients = []

    def factory(**flags):
        client, context = make(**flags)
        client.__enter__()
        clients.append(client)
        return client, context

    yield factory
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture(scope="session")
def smollm_server():
    """One real server for the whole session: the embedded SmolLM2 (fp32, CPU), every default
    dialect. Tests using it are end-to-end; keep their max_tokens small."""
    with serving("--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "32",
                 "--log-level", "warning", timeout=300) as server:
        yield server
