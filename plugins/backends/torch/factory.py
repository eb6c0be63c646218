"""Pick the torch backend class for the configured task (vLLM-style ``--task``)."""

from __future__ import annotations

from typing import Any

from llmserve.engine.backend import Backend

from .options import TorchOptions


def create(config: Any, options: TorchOptions | None = None) -> Backend:
    """The backend for ``config.task``; ``options`` drive the generation backend's execution plan
    (the embedding backend has no switches)."""
    if getattr(config, "task", "generate") == "embed":
        from .pooling import TorchEmbeddingBackend

        return TorchEmbeddingBackend(config)
    from .runner import TorchBackend

    return TorchBackend(config, options)
