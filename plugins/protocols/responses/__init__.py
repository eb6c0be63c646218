"""Built-in ``responses`` protocol: the OpenAI Responses API (``/v1/responses``)."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="responses", target="llmserve.plugins.protocols.responses.protocol:ResponsesProtocol",
                         description="POST /v1/responses; GET and DELETE /v1/responses/{id} with the opt-in store",
                         options="llmserve.plugins.protocols.responses.wire:ResponsesOptions")]
