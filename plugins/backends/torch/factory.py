"""Pick the torch backend class for the configured task (vLLM-style ``--task``)."""

from __future__ import annotations

from typing import Any

from llmserve.engine.backend import Backend


def create(config: Any) -> Backend:
    if getattr(config, "task", "generate") == "embed":
        from .pooling import TorchEmbeddingBackend

        return TorchEmbeddingBackend(config)
    from .runner import TorchBackend

    return TorchBackend(config)
