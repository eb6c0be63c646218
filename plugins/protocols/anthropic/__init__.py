"""Built-in ``anthropic`` protocol: the Anthropic Messages API (``/v1/messages``)."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="anthropic", target="llmserve.plugins.protocols.anthropic.protocol:AnthropicProtocol",
                         description="POST /v1/messages (streamed events too), /v1/messages/count_tokens",
                         options="llmserve.plugins.protocols.anthropic.wire:AnthropicOptions")]
