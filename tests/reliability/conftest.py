"""Fixtures for the reliability tests: a real uvicorn server running in this process.

``inproc_server(**flags)`` builds the server exactly like ``llmserve serve`` does (same
``LLMServer``, same middleware) and runs it on a loopback port in a thread, so a test can
talk HTTP to it and still reach the engine object to check its idle invariant (no request
records, every KV block free).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

from conftest import ECHO_PLUGIN, free_port


class InProcServer:
    def __init__(self, **flags: Any) -> None:
        from llmserve.config import load_config
        from llmserve.hooks.manager import PluginManager
        from llmserve.server.lifecycle import make_server
        from llmserve.server.serve import build_server

        flags.setdefault("log_level", "warning")
        flags.setdefault("host", "127.0.0.1")
        flags.setdefault("timeout_keep_alive", 600)  # see ServerProcess: no keep-alive race in tests
        config, _ = load_config(flags, environ={})
        app, self.context = build_server(config, PluginManager().load(autoload=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, self.context, port=self.port)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    @property
    def engine(self) -> Any:
        return self.context.engine.engine

    def check_idle(self, timeout: float = 15.0) -> None:
        """Wait until the engine holds no request and every block is free (the engine's own
        invariant check, run on the engine thread); fail with its message otherwise."""
        deadline = time.time() + timeout
        while True:
            try:
                assert asyncio.run(self.context.engine.check_idle())
                return
            except AssertionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def inproc_server():
    started: list[InProcServer] = []

    def start(**flags: Any) -> InProcServer:
        server = InProcServer(**flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def echo_flags() -> dict[str, Any]:
    """Flags for an echo-backend server (no model load)."""
    return {"backend": "echo", "plugins": [ECHO_PLUGIN], "trust_request_chat_template": True}


@pytest.fixture(scope="session")
def smollm_inproc():
    """The embedded SmolLM2 (fp32, CPU) served in this process, shared by this package's tests.
    Requests whose id contains ``maskfail`` get a logits mask that raises (fault injection)."""
    old = os.environ.get("LLMSERVE_FAULT_INJECTION")
    os.environ["LLMSERVE_FAULT_INJECTION"] = "mask:maskfail"
    try:
        server = InProcServer(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=16)
    finally:
        if old is None:
            os.environ.pop("LLMSERVE_FAULT_INJECTION", None)
        else:
            os.environ["LLMSERVE_FAULT_INJECTION"] = old
    yield server
    server.stop()
