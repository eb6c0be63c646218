"""Built-in ``ops`` protocol: the health routes every dialect's clients probe (/health, /ping)."""

from llmserve import hookimpl
from llmserve.contributions import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="ops", target="llmserve.plugins.protocols.ops.routes:OpsProtocol",
                         description="GET /health, GET|POST /ping (shared by the OpenAI, TGI and vLLM dialects)")]
