"""Built-in ``openai`` protocol: the OpenAI API with vLLM's and FastDeploy's extra parameters."""

from llmserve import hookimpl
from llmserve import ProtocolSpec


@hookimpl
def register_protocols() -> list[ProtocolSpec]:
    return [ProtocolSpec(name="openai", target="llmserve.plugins.protocols.openai.protocol:OpenAIProtocol",
                         description="/v1/chat/completions, /v1/completions, /v1/models, /version",
                         aliases=("vllm",))]
