"""Built-in ``triton`` protocol (alias ``kserve``): KServe v2 / Triton HTTP routes, the binary
tensor extension tritonclient uses by default, and MindIE's flavour of the generate extension."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="triton", target="llmserve.plugins.protocols.triton.protocol:TritonProtocol",
                         description="/v2, /v2/health/*, /v2/models/{m}[/versions/{v}][/ready|/config|/infer|"
                                     "/generate|/generate_stream]",
                         aliases=("kserve",))]
