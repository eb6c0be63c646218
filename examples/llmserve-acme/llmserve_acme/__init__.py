"""The acme plugin: registers a protocol, a tool parser and a speculative-decoding proposer.
Import-light on purpose: only records are built here; the implementations load when used."""

from llmserve import hookimpl
from llmserve import ProposerSpec, ProtocolSpec, ToolParserSpec


@hookimpl
def register_protocols():
    return [ProtocolSpec(name="acme", target="llmserve_acme.protocol:AcmeProtocol",
                         description="POST /acme/shout: generate, then upper-case the text",
                         options="llmserve_acme.protocol:AcmeOptions")]


@hookimpl
def register_tool_parsers():
    return [ToolParserSpec(name="acme", target="llmserve_acme.parser:AcmeToolParser",
                           description="CALL name {json} lines")]


@hookimpl
def register_proposers():
    return [ProposerSpec(name="acme-replay", target="llmserve_acme.proposer:ReplayProposer",
                         description="proposes that the output repeats the prompt")]
