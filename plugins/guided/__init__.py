"""Built-in ``lm-format-enforcer`` guided decoder: JSON schemas, JSON objects, regexes, choices,
structures.

Only the record lives here; ``lmfe.py`` (and lmformatenforcer itself) is imported on the first
guided request.
"""

from llmserve import hookimpl
from llmserve import GuidedDecoderSpec


@hookimpl
def register_guided_decoders() -> list[GuidedDecoderSpec]:
    return [GuidedDecoderSpec(name="lm-format-enforcer",
                              target="llmserve.plugins.guided.lmfe:LMFormatEnforcerDecoder",
                              description="json_schema, json_object, regex, choice and structure via "
                                          "lm-format-enforcer")]
