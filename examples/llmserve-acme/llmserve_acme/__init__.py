"""The acme plugin: registers a protocol and a tool parser. Import-light on purpose:
only records are built here; the implementations load when used."""

from llmserve import hookimpl
from llmserve import ProtocolSpec, ToolParserSpec


@hookimpl
def register_protocols():
    return [ProtocolSpec(name="acme", target="llmserve_acme.protocol:AcmeProtocol",
                         description="POST /acme/shout: generate, then upper-case the text",
                         options="llmserve_acme.protocol:AcmeOptions")]


@hookimpl
def register_tool_parsers():
    return [ToolParserSpec(name="acme", target="llmserve_acme.parser:AcmeToolParser",
                           description="CALL name {json} lines")]
