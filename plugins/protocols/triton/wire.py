"""Triton / KServe v2 request models (MindIE's flavour of the generate and token-infer routes).

Ranges follow the MindIE service spec; unknown fields are ignored and explicit nulls mean
"default" (``dialect_kit.WireModel``). Also the names of the tensors this server serves.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import Field

from llmserve import InvalidRequestError
from llmserve import WireModel

from ..mindie.params import INT32_MAX, UINT64_MAX

ID_DESCRIPTION = "Request id: 1-256 characters of letters, digits, '_' and '-'; echoed in the reply."
VERSION = "1"  # the one version of the one model served
_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
TOKEN_INPUT, TOKEN_OUTPUT = "input0", "output0"      # UINT32 token ids in, token ids out
TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"  # BYTES text in, text out


def check_id(value: str | None) -> str | None:
    """A request ``id`` as KServe allows it (it is echoed in replies and logs)."""
    if value is not None and not _ID.match(value):
        raise InvalidRequestError("id: must be 1-256 characters of letters, digits, '_' and '-'", param="id")
    return value


class SamplingParameters(WireModel):
    """Parameters of the token (``input0``) and text (``text_input``) inference routes."""

    temperature: float | None = Field(None, gt=1e-6, description="> 1e-6, default 1.0.")
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, description="[0, 2147483647]; 0 disables (default).")
    top_p: float | None = Field(None, gt=1e-6, le=1.0, description="(1e-6, 1.0], default 1.0.")
    do_sample: bool | None = Field(None, description="false: greedy; absent: sample when a sampling parameter is set.")
    seed: int | None = Field(None, gt=0, le=UINT64_MAX, description="(0, 2^64-1]; random when sampling without one.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="> 0, default 1.0.")
    max_new_tokens: int | None = Field(None, gt=0, le=INT32_MAX,
                                       description="(0, 2147483647], default 20; capped to the context left.")
    watermark: bool | None = Field(None, description="Accepted and ignored (not supported, as in MindIE).")
    details: bool | None = Field(None, description="Ignored on /infer (generate routes only).")
    perf_stat: bool | None = Field(None, description="Ignored on /infer (generate routes only).")
    batch_size: int | None = Field(None, gt=0, le=INT32_MAX, description="Ignored on /infer (generate routes only).")
    priority: int | None = Field(None, ge=1, le=5, description="1 (highest) .. 5 (default).")
    timeout: int | None = Field(None, gt=0, le=3600, description="Seconds, (0, 3600], default 600.")
    binary_data_output: bool | None = Field(None, description="Return every output as binary tensor data.")


class GenerateParameters(WireModel):
    """``parameters`` of ``/v2/models/{m}/generate`` and ``/generate_stream``."""

    details: bool | None = Field(None, description="Return `details` (finish_reason, generated_tokens, timings).")
    do_sample: bool | None = Field(None, description="false: greedy; absent: sample when a sampling parameter is set.")
    max_new_tokens: int | None = Field(None, gt=0, le=INT32_MAX,
                                       description="(0, 2147483647], default 20; capped to the context left.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="> 0, default 1.0.")
    seed: int | None = Field(None, gt=0, le=UINT64_MAX, description="(0, 2^64-1]; random when sampling without one.")
    temperature: float | None = Field(None, gt=1e-6, description="> 1e-6, default 1.0.")
    top_k: int | None = Field(None, ge=0, le=INT32_MAX, description="[0, 2147483647]; 0 disables (default).")
    top_p: float | None = Field(None, gt=1e-6, le=1.0, description="(1e-6, 1.0], default 1.0.")
    batch_size: int | None = Field(None, gt=0, le=INT32_MAX, description="(0, 2147483647]; validated, not used.")
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description="(0, 1.0]; typical sampling.")
    watermark: bool | None = Field(None, description="Accepted and ignored (not supported, as in MindIE).")
    perf_stat: bool | None = Field(None, description="Add details.perf_stat: [[token_id, ms], ...].")
    priority: int | None = Field(None, ge=1, le=5, description="1 (highest) .. 5 (default).")
    timeout: int | None = Field(None, gt=0, le=3600, description="Seconds, (0, 3600], default 600.")


GENERATE_PARAMETER_NAMES = tuple(GenerateParameters.model_fields)


class GenerateBody(WireModel):
    """Body of ``/v2/models/{m}/generate`` and ``/generate_stream``.

    Parameters may also be given at the top level (the Triton generate extension maps extra
    top-level keys to parameters; ``max_tokens`` is read as ``max_new_tokens``); a key inside
    ``parameters`` wins.
    """

    id: str | None = Field(None, description=ID_DESCRIPTION)
    text_input: Union[str, list[Any]] = Field(description="The prompt (non-empty; multimodal lists are not supported).")
    parameters: GenerateParameters | None = None


class InferTensor(WireModel):
    name: str
    shape: list[Annotated[int, Field(ge=0)]]
    datatype: str
    parameters: dict[str, Any] | None = Field(None, description="binary_data_size for binary tensor data.")
    data: Any = Field(None, description="Row-major values, flat or nested (absent for binary tensors).")


class InferRequestedOutput(WireModel):
    name: str
    parameters: dict[str, Any] | None = Field(None, description="binary_data: return this output in binary.")


class InferBody(WireModel):
    """``POST /v2/models/{m}/infer``: UINT32 ``input0`` token ids (-> ``output0``) or BYTES
    ``text_input`` (-> ``text_output``)."""

    id: str | None = Field(None, description=ID_DESCRIPTION)
    parameters: SamplingParameters | None = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[InferRequestedOutput] | None = None


class RepositoryIndexBody(WireModel):
    ready: bool | None = Field(None, description="Only list ready models.")
