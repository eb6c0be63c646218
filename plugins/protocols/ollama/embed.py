"""``/api/embed`` and the legacy ``/api/embeddings`` on an embedding server (``--task embed``).

``/api/embed`` cuts inputs to the context length unless ``truncate`` is false (then too long
an input is a 400), and ``dimensions`` keeps the first N dimensions, renormalized to unit
length. An empty ``input`` (or legacy ``prompt``) just "loads" the model, as in Ollama.
"""

from __future__ import annotations

import math
import time
from typing import Any

from starlette.responses import JSONResponse

from .params import invalid, keep_alive_seconds, resolve_model
from .wire import EmbeddingsRequest, EmbedRequest

NS = 1_000_000_000


def _shorten(vector: list[float], dimensions: int) -> list[float]:
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm else head


class Embeddings:
    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    def _ids(self, texts: list[str], truncate: bool, param: str) -> list[list[int]]:
        """Token ids of ``texts``; blocks while it tokenizes: run in a tokenizer thread (``in_worker``)."""
        engine = self.p.context.engine
        limit = engine.max_model_len
        out = []
        for i, text in enumerate(texts):
            ids = engine.encode(text)
            if len(ids) > limit:
                if not truncate:
                    raise invalid(f"input {i} has {len(ids)} tokens, more than the context length of {limit} "
                                  f"(send truncate true to cut it)", param)
                ids = ids[: limit - 1] + ids[-1:]  # keep the closing special token
            out.append(ids)
        return out

    async def embed(self, body: EmbedRequest) -> JSONResponse:
        started = time.time()
        resolve_model(self.p.context, body.model)
        self.p.context.keep_model_alive(keep_alive_seconds(body.keep_alive))
        model = body.model or self.p.context.model_name
        texts = [body.input] if isinstance(body.input, str) else list(body.input or [])
        if not texts:
            return JSONResponse({"model": model, "embeddings": []})
        if body.dimensions is not None and body.dimensions < 1:
            raise invalid("dimensions must be a positive number", "dimensions")
        ids = await self.p.context.engine.in_worker(self._ids, texts, body.truncate is not False, "input")
        vectors = await self.p.context.engine.embed(ids, param="input")
        if body.dimensions is not None:
            if body.dimensions > len(vectors[0]):
                raise invalid(f"dimensions: this model produces {len(vectors[0])}-dimensional embeddings",
                              "dimensions")
            vectors = [_shorten(v, body.dimensions) for v in vectors]
        total = int((time.time() - started) * NS)
        return JSONResponse({"model": model, "embeddings": vectors, "total_duration": total, "load_duration": 0,
                             "prompt_eval_count": sum(map(len, ids))})

    async def embeddings(self, body: EmbeddingsRequest) -> JSONResponse:
        resolve_model(self.p.context, body.model)
        if not body.prompt:
            return JSONResponse({"embedding": []})
        ids = await self.p.context.engine.in_worker(self._ids, [body.prompt], True, "prompt")
        vectors = await self.p.context.engine.embed(ids, param="prompt")
        return JSONResponse({"embedding": vectors[0]})
