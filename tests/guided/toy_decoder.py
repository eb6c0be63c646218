"""A test plugin contributing a guided decoder: ``toy-literal``.

Its only kind is ``grammar``, and its "grammar" is a literal: the output must be exactly the
grammar text. Masks work on any tokenizer whose tokens are single UTF-8 bytes (the test
backends'), which is enough to show a third-party decoder end to end.
"""

from __future__ import annotations

from llmserve import hookimpl
from llmserve.hooks.records import GuidedDecoderSpec
from llmserve.errors import InvalidRequestError
from llmserve.guided import GuidedDecoder, GuidedSpec

BUILT: list[str] = []  # one entry per decoder instance, to check it is built once


class LiteralMask:
    def __init__(self, data: bytes, eos: list[int]) -> None:
        self.data, self.eos = data, eos

    def allowed(self, output_token_ids: list[int]) -> list[int]:
        n = len(output_token_ids)
        return [self.data[n]] if n < len(self.data) else list(self.eos)


class ToyLiteralDecoder(GuidedDecoder):
    name = "toy-literal"
    kinds = frozenset({"grammar"})

    def __init__(self, tokenizer, vocab_size, eos_token_ids):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        BUILT.append(self.name)

    def compile(self, spec: GuidedSpec):
        if spec.value.startswith("!"):
            raise InvalidRequestError(f"{spec.param}: a literal grammar may not start with '!'", param=spec.param)
        data = spec.value.encode()
        return lambda: LiteralMask(data, self.eos_token_ids)


@hookimpl
def register_guided_decoders():
    return [GuidedDecoderSpec(name="toy-literal", target=f"{__name__}:ToyLiteralDecoder",
                              description="test decoder: the output is the grammar text, verbatim")]
