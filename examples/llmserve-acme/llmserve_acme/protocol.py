"""A tiny dialect: POST /acme/shout {"text": ..., "max_tokens": ...} -> {"shout": ...}."""

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.responses import JSONResponse

from llmserve.server.protocol import Protocol
from llmserve.request import GenerateRequest
from llmserve.sampling import SamplingParams


class AcmeOptions(BaseModel):
    """Options from the `acme:` section of the YAML config."""

    exclamations: int = 1


class ShoutRequest(BaseModel):
    text: str
    max_tokens: int = 16


class AcmeProtocol(Protocol):
    def router(self) -> APIRouter:
        router = APIRouter()
        bangs = "!" * (self.options.exclamations if self.options else 1)

        @router.post("/acme/shout")
        async def shout(body: ShoutRequest):
            request = GenerateRequest(prompt=body.text,
                                      sampling=SamplingParams.build(max_tokens=body.max_tokens, temperature=0))
            text = ""
            async for event in self.context.engine.generate(request):
                text += "".join(d.text for d in event.outputs)
            return {"shout": text.upper() + bangs, "model": self.context.model_name}

        return router

    def error_response(self, error, request):
        return JSONResponse({"acme_error": error.message}, status_code=error.status)
