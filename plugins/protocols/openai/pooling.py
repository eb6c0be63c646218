"""Embeddings, score and rerank routes for an embedding model (``--task embed``); inputs are
tokenized in the engine client's tokenizer threads, off the event loop."""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any, Literal, Union

from pydantic import Field
from starlette.responses import JSONResponse

from llmserve import InvalidRequestError
from llmserve import WireModel

from .params import now, truncate, truncation

Inputs = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(WireModel):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None


class ScoreRequest(WireModel):
    """vLLM's score request under each of its spellings: ``text_1``/``text_2``,
    ``queries``/``documents``, ``queries``/``items`` and ``data_1``/``data_2``."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    def pair(self) -> tuple[list[str], list[str]]:
        """The two sides, from the first spelling the request used (the error names it)."""
        for first, second in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                              ("data_1", "data_2")):
            if getattr(self, first) is not None and getattr(self, second) is not None:
                return _texts(getattr(self, first), first), _texts(getattr(self, second), second)
        for first, second in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
            if getattr(self, first) is not None:
                raise InvalidRequestError(f"{second} is required", param=second)
        raise InvalidRequestError("text_1 is required", param="text_1")


class RerankRequest(WireModel):
    query: str
    documents: list[Union[str, dict[str, Any]]] = Field(min_length=1)
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = True


def _as_id_lists(engine: Any, value: Inputs, add_special: bool, param: str) -> list[list[int]]:
    if isinstance(value, str):
        value = [value]
    if not value:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if all(isinstance(v, int) for v in value):
        return [list(value)]  # type: ignore[arg-type]
    if all(isinstance(v, str) for v in value):
        return [engine.encode(v, add_special) for v in value]  # type: ignore[arg-type]
    if all(isinstance(v, list) for v in value):
        return [list(v) for v in value]  # type: ignore[arg-type]
    raise InvalidRequestError(f"{param} must be a string, a list of strings, or token ids", param=param)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _texts(value: str | list[str] | None, param: str) -> list[str]:
    if value is None:
        raise InvalidRequestError(f"{param} is required", param=param)
    items = [value] if isinstance(value, str) else value
    if not items:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    return items


class Pooling:
    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    async def embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        ctx = self.p.context
        model = ctx.check_model(body.model)
        keep = truncation(body, ctx.engine.max_model_len)
        # In a tokenizer thread: a long input must not hold the event loop while it is tokenized.
        ids = await ctx.engine.in_worker(_as_id_lists, ctx.engine, body.input, body.add_special_tokens is not False,
                                         "input")
        ids = [truncate(i, keep, body.truncation_side) for i in ids]
        vectors = await ctx.engine.embed(ids)
        if body.dimensions is not None and body.dimensions != len(vectors[0]):
            raise InvalidRequestError(f"dimensions: this model only produces {len(vectors[0])}-dimensional "
                                      f"embeddings", param="dimensions")
        data = []
        for i, vec in enumerate(vectors):
            value: Any = vec
            if body.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(map(len, ids))
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _scores(self, first: list[str], second: list[str]) -> tuple[list[float], int]:
        engine = self.p.context.engine
        if len(first) == 1 and len(second) >= 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequestError("text_1 and text_2 must have the same length (or text_1 one item)",
                                      param="text_2")
        texts = list(dict.fromkeys(first + second))
        ids = await engine.in_worker(lambda: [engine.encode(t) for t in texts])
        vectors = dict(zip(texts, await engine.embed(ids, param="text_1")))
        return [_cosine(vectors[a], vectors[b]) for a, b in zip(first, second)], sum(map(len, ids))

    async def score(self, body: ScoreRequest) -> JSONResponse:
        model = self.p.context.check_model(body.model)
        first, second = body.pair()
        scores, tokens = await self._scores(first, second)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": now(), "model": model,
                             "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank(self, body: RerankRequest, cohere: bool) -> JSONResponse:
        model = self.p.context.check_model(body.model)
        docs = []
        for i, d in enumerate(body.documents):
            text = d if isinstance(d, str) else d.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"documents[{i}] must be a string or an object with text",
                                          param="documents")
            docs.append(text)
        if body.top_n is not None and body.top_n < 1:
            raise InvalidRequestError("top_n must be at least 1", param="top_n")
        scores, tokens = await self._scores([body.query], docs)
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)[: body.top_n or len(docs)]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents is not False:
                item["document"] = {"text": docs[i]}
            results.append(item)
        out: dict[str, Any] = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        if cohere:
            out["meta"] = {"billed_units": {"search_units": 1}}
        return JSONResponse(out)
