"""Pick the torch backend class for the configured task (vLLM-style ``--task``)."""

from __future__ import annotations

from typing import Any

from llmserve.engine.backend import Backend
from llmserve.errors import ConfigError

from .options import TorchOptions


def create(config: Any, options: TorchOptions | None = None) -> Backend:
    """The backend for ``config.task``; ``options`` drive the generation backend's execution plan
    (the embedding backend has no switches)."""
    tp = int(getattr(config, "tensor_parallel_size", 1) or 1)
    if getattr(config, "task", "generate") == "embed":
        if tp > 1:
            raise ConfigError("--tensor-parallel-size applies to generation models; serve an embedding model "
                              "with --tensor-parallel-size 1")
        from .pooling import TorchEmbeddingBackend

        return TorchEmbeddingBackend(config)
    if tp > 1:
        from .tensor_parallel import TensorParallelBackend

        return TensorParallelBackend(config, options)
    from .runner import TorchBackend

    return TorchBackend(config, options)
