"""The PyTorch + transformers backend: paged KV cache, batched forward and sampling on CPU or CUDA,
and pooled embeddings for ``--task embed``.

Kept import-light on purpose: torch and transformers load only when the backend is created.
"""

from llmserve import hookimpl
from llmserve import BackendSpec


@hookimpl
def register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="torch", target="llmserve.plugins.backends.torch.factory:create",
                        description="transformers models on a paged KV cache (CPU, CUDA); embeddings with --task embed",
                        options="llmserve.plugins.backends.torch.options:TorchOptions")]
