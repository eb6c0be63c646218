"""Built-in ``vllm_native`` protocol: vLLM's (and MindIE's) native ``POST /generate`` with ``prompt``."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="vllm_native",
                         target="llmserve.plugins.protocols.vllm_native.protocol:VLLMNativeProtocol",
                         description="POST /generate with `prompt` -> {\"text\": [...]}, `\\0`-separated stream",
                         aliases=("vllm-native",),
                         options="llmserve.plugins.protocols.vllm_native.protocol:VLLMNativeOptions")]
