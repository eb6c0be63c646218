"""A fake Hub on loopback per test, and the environment that points huggingface_hub and llmserve at
it (``HF_ENDPOINT``) and at a cache in the test's tmp dir (``HF_HOME``). CI runs the suite with
``HF_HUB_OFFLINE=1``: these tests lift it for themselves only, and still reach nothing but
127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_hub import FakeHub


@pytest.fixture
def fake_hub():
    hub = FakeHub().start()
    yield hub
    hub.stop()


@pytest.fixture
def hub_env(tmp_path, fake_hub, monkeypatch):
    """The variables a subprocess needs; also applied to this process (huggingface_hub's import-time
    offline switch included)."""
    from huggingface_hub import constants

    env = {"HF_ENDPOINT": fake_hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "LLMSERVE_PROGRESS": "plain"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return env
