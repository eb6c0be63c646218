"""Built-in ``tgi`` protocol: Hugging Face text-generation-inference's native API."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="tgi", target="llmserve.plugins.protocols.tgi.protocol:TGIProtocol",
                         description="POST / , /generate, /generate_stream, /tokenize; GET /info",
                         options="llmserve.plugins.protocols.tgi.wire:TGIOptions")]
