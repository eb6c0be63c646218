"""Built-in ``ollama`` protocol: the Ollama API (``/api/chat``, ``/api/generate``, ``/api/tags``, ...)."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="ollama", target="llmserve.plugins.protocols.ollama.protocol:OllamaProtocol",
                         description="GET / , /api/tags, /api/show, /api/ps, /api/chat, /api/generate, /api/embed")]
