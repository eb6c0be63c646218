"""What Triton's route modules (``infer.py``, ``generate.py``) take from their ``TritonProtocol``:
one request's collected output (``Result``) and the protocol's request helpers, typed
structurally (``TritonHost``): ``protocol.py`` imports the route modules, so they do not import
it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from llmserve import RequestOutput
from llmserve import PreparedRequest
from llmserve import ErrorFormat

from ..mindie.events import TokenClock

if TYPE_CHECKING:
    from llmserve import ServerContext


@dataclass
class Result:
    """One request's whole output."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    clock: TokenClock = field(default_factory=TokenClock)
    last: RequestOutput | None = None


class TritonHost(ErrorFormat, Protocol):
    """The ``TritonProtocol`` members the routes call (``protocol.py`` documents them)."""

    context: ServerContext

    def check_model(self, name: str, version: str | None = None) -> str: ...

    def engine(self) -> Any: ...

    async def read_body(self, request: Request) -> bytes: ...

    async def new_request(self, params: Any, text: str | None = None, ids: list[int] | None = None,
                          param: str = ...) -> PreparedRequest: ...

    async def collect(self, req: PreparedRequest) -> Result: ...
