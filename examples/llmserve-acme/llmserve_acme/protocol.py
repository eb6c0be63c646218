"""A tiny dialect: POST /acme/shout {"text": ..., "max_tokens": ...} -> {"shout": ...}."""

from fastapi import APIRouter
from pydantic import BaseModel

from llmserve import GenerateRequest
from llmserve import SamplingParams
from llmserve import WireModel, dialect_router
from llmserve import Protocol


class AcmeOptions(BaseModel):
    """Options from the `acme:` section of the YAML config."""

    exclamations: int = 1


class ShoutRequest(WireModel):
    text: str
    max_tokens: int = 16


class AcmeProtocol(Protocol):
    error_schema = {"type": "object", "required": ["acme_error"], "properties": {"acme_error": {"type": "string"}}}

    def router(self) -> APIRouter:
        router = dialect_router(self)
        bangs = "!" * (self.options.exclamations if self.options else 1)

        @router.post("/acme/shout")
        async def shout(body: ShoutRequest):
            request = await self.context.engine.aprepare(GenerateRequest(
                prompt=body.text, sampling=SamplingParams.build(max_tokens=body.max_tokens, temperature=0)))
            text = ""
            async for event in self.context.engine.generate(request):
                text += "".join(d.text for d in event.outputs)
            return {"shout": text.upper() + bangs, "model": self.context.model_name}

        return router

    def error_body(self, error):
        return error.status, {"acme_error": error.message}
