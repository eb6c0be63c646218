"""The Responses protocol: ``POST /v1/responses`` (in ``create.py``) and, for the opt-in
store, ``GET`` / ``DELETE /v1/responses/{response_id}``. Errors use the OpenAI envelope
(the default ``Protocol.error_body``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmserve import LLMServeError, NotFoundError
from llmserve import dialect_router
from llmserve import presented_key
from llmserve import SSE_RESPONSES, STREAM_HEADERS
from llmserve import Protocol

from .background import Background, frames
from .create import Create
from .store import ResponseStore
from .wire import ResponsesOptions, ResponsesRequest


class ResponsesProtocol(Protocol):
    """The OpenAI Responses API, stateless unless the ``responses:`` section turns the store on."""

    named_error_codes = True  # context_length_exceeded, as OpenAI's API names it

    def __init__(self, context: Any, options: ResponsesOptions | None = None) -> None:
        super().__init__(context, options)
        self.opts = options or ResponsesOptions()
        self.store = ResponseStore(self.opts.store_max_responses, self.opts.store_max_bytes) if self.opts.store \
            else None
        self.create = Create(self)
        self.background = Background(self, self.create)

    def owner(self, request: Request) -> str:
        """Whose responses a request may read: its API key's, when the server has keys."""
        return ResponseStore.owner(presented_key(request.headers)) if self.context.config.http.api_key else ""

    def _stored(self, request: Request, response_id: str) -> tuple[str, Any]:
        owner = self.owner(request)
        entry = self.store.get(owner, response_id) if self.store is not None else None
        if entry is None:
            raise NotFoundError(f"Response with id '{response_id[:100]}' not found.", param="response_id")
        return owner, entry

    def router(self) -> APIRouter:
        router = dialect_router(self, tags=["OpenAI Responses"])
        create = self.create

        @router.post("/v1/responses", responses=SSE_RESPONSES,
                     summary="Create a response: a JSON response object, or SSE events when `stream` is true")
        async def create_response(body: ResponsesRequest, request: Request) -> Response:
            self.context.admission.check(1)  # before any templating or tokenizing
            return await create(body, request)

        @router.get("/v1/responses/{response_id}", responses=SSE_RESPONSES,
                    summary="A stored response (needs the response store); a background one's events with stream")
        async def get_response(response_id: str, request: Request, stream: bool = False,
                               starting_after: int | None = None) -> Response:
            owner, entry = self._stored(request, response_id)
            if stream:  # a background response's events after starting_after, then the rest as they come
                run = self.background.run_of(owner, response_id)
                events = run.follow(-1 if starting_after is None else starting_after)
                return self.context.sse_response(frames(events), headers=STREAM_HEADERS)
            return JSONResponse(entry.response)

        @router.post("/v1/responses/{response_id}/cancel", summary="Cancel a background response")
        async def cancel_response(response_id: str, request: Request) -> Response:
            owner, entry = self._stored(request, response_id)
            return JSONResponse(await self.background.cancel(owner, response_id, entry.response))

        @router.delete("/v1/responses/{response_id}", summary="Delete a stored response")
        async def delete_response(response_id: str, request: Request) -> Response:
            owner, _ = self._stored(request, response_id)
            assert self.store is not None
            self.store.delete(owner, response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

        return router

    def error_response(self, error: LLMServeError, request: Request | None) -> Response:
        """The OpenAI envelope, telling the openai client not to retry a client error."""
        response = super().error_response(error, request)
        if error.status < 500 and error.status != 429:
            response.headers["x-should-retry"] = "false"
        return response
