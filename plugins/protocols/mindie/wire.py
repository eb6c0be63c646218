"""MindIE native request models (``POST /infer``, ``POST /v1/tokenizer``), ranges per the
MindIE service spec. Unknown fields are ignored and explicit nulls mean "default"."""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field

from llmserve import WireModel

from .params import INT32_MAX, UINT64_MAX


class InferParameters(WireModel):
    temperature: float | None = Field(None, gt=1e-6, description="> 1e-6, default 1.0.")
    top_k: int | None = Field(None, gt=0, le=INT32_MAX, description="(0, 2147483647]; unset: no top-k.")
    top_p: float | None = Field(None, gt=1e-6, lt=1.0,
                                description="(1e-6, 1.0) exclusive; unset means 1.0, which may not be sent.")
    max_new_tokens: int | None = Field(None, gt=0, le=INT32_MAX,
                                       description="(0, 2147483647], default 20; capped to the context left.")
    do_sample: bool | None = Field(None, description="false: greedy; absent: sample when a sampling parameter is set.")
    seed: int | None = Field(None, gt=0, le=UINT64_MAX, description="(0, 2^64-1]; random when sampling without one.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="> 0, default 1.0.")
    details: bool | None = Field(None, description="Return details (finish_reason, generated_tokens, seed).")
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description="(0, 1.0], default 1.0.")
    watermark: bool | None = Field(None, description="Accepted and ignored (not supported, as in MindIE).")
    priority: int | None = Field(None, ge=1, le=5, description="1 (highest) .. 5 (default).")
    timeout: int | None = Field(None, gt=0, le=3600, description="Seconds, (0, 3600], default 600.")
    # A parameter of the MindIE family (its Triton-style generate routes); held to the family's range
    # here too, so that a client sending it to /infer learns of a bad value instead of having it dropped.
    batch_size: int | None = Field(None, gt=0, le=INT32_MAX, description="(0, 2147483647]; validated, not used "
                                                                          "(the engine batches continuously).")


class InferBody(WireModel):
    inputs: Union[str, list[Any]] = Field(
        description="The prompt: non-empty text, or a multimodal list of {\"type\": \"text\", \"text\"} and "
                    "{\"type\": \"image_url\", \"image_url\"} items (a vision model's).")
    stream: bool | None = Field(False, description="true: SSE stream, one event per token.")
    parameters: InferParameters | None = None


class TokenizerBody(WireModel):
    inputs: str = Field(min_length=1, description="The text to tokenize.")
    do_decode: bool | None = Field(None, description="true (default): each token as decoded text; false: the "
                                                     "tokenizer's raw token strings.")
