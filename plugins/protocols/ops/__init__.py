"""Built-in ``ops`` protocol: liveness (/health, /ping), readiness (/ready) and /metrics."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="ops", target="llmserve.plugins.protocols.ops.protocol:OpsProtocol",
                         description="GET /health, GET|POST /ping (liveness), GET /ready (readiness), "
                                     "GET /metrics (Prometheus)")]
