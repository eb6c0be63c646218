"""Built-in ``responses`` protocol: the OpenAI Responses API (``/v1/responses``).

The routes land with ``protocol.py``; until then this plugin contributes nothing.
"""

from llmserve import hookimpl
from llmserve.hooks.records import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return []
