"""Built-in ``web`` protocol: the browser pages (chat playground at ``GET /``, Swagger UI, ReDoc)."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="web", target="llmserve.plugins.protocols.web.protocol:WebProtocol",
                         description="GET / for browsers (chat playground; other clients get their dialect's "
                                     "answer), /playground, /docs (Swagger UI), /redoc, /assets/*")]
