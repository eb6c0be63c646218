"""Built-in ``mindie`` protocol: MindIE's native ``POST /infer`` (text and SSE stream) and
``POST /v1/tokenizer``, with MindIE's error format. MindIE's Triton-style routes
(``/v2/models/{m}/generate``, token ``/infer``) are served by the ``triton`` protocol."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="mindie", target="llmserve.plugins.protocols.mindie.protocol:MindIEProtocol",
                         description="POST /infer (MindIE native, stream or not), POST /v1/tokenizer")]
