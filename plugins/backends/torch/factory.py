"""Pick the torch backend class for the configured task (vLLM-style ``--task``)."""

from __future__ import annotations


from llmserve import ServerConfig
from llmserve import Backend
from llmserve import ConfigError

from .options import TorchOptions


def create(config: ServerConfig, options: TorchOptions | None = None) -> Backend:
    """The backend for the model section's ``task``; ``options`` drive the generation backend's execution plan
    (the embedding backend has no switches)."""
    tp = config.parallel.tensor_parallel_size
    if config.llm.task == "embed":
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
