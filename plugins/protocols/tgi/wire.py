"""TGI request models and the ``tgi:`` options section.

Every parameter is optional and nullable (text-generation sends all of them, most as null);
unknown keys are ignored, NaN and Infinity refused (``dialect_kit.WireModel``). Types are
checked here; TGI's range rules (with TGI's wording) are checked in ``params.py`` so that
their messages match TGI's exactly.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from llmserve import WireModel


class TGIOptions(BaseModel):
    """Options from the ``tgi:`` section of the YAML config (TGI's launcher flags)."""

    model_config = ConfigDict(extra="forbid")

    max_best_of: int = Field(2, ge=1, description="Largest `best_of` accepted (TGI --max-best-of).")
    max_stop_sequences: int = Field(4, ge=0,
                                    description="Most `stop` sequences per request (TGI --max-stop-sequences).")
    max_top_n_tokens: int = Field(5, ge=0, le=20, description="Largest `top_n_tokens` (TGI --max-top-n-tokens).")
    max_input_tokens: int | None = Field(None, ge=1,
                                         description="Longest prompt in tokens (default: context length - 1).")
    default_max_new_tokens: int | None = Field(
        20, ge=1, description="`max_new_tokens` when a request gives none. 20 (old TGI, MindIE, the clients' own "
                              "default); null: current TGI's rule, min(context - prompt, 1024).")
    compat_return_full_text: bool = Field(
        False, description="`return_full_text` default on `POST /` (TGI: true for text-generation models).")
    max_client_batch_size: int = Field(4, ge=1, description="Reported in /info (no batch route uses it).")


class Grammar(WireModel):
    """``{"type": "json" | "json_object" | "json_schema" | "regex", "value": ...}``."""

    type: str = Field(description="json (alias json_object), json_schema or regex")
    value: Any = Field(None, description="json: a JSON schema (object or string); json_schema: "
                                         "{\"name\"?, \"schema\"}; regex: a regular expression")


class GenerateParameters(WireModel):
    """TGI's ``parameters`` object."""

    adapter_id: str | None = Field(None, description="LoRA adapter id: not supported (only null / \"None\").")
    best_of: int | None = Field(None, description="Generate best_of sequences, return the best (needs sampling).")
    decoder_input_details: bool | None = Field(
        None, description="Return the prompt tokens with logprobs (not on streams).")
    details: bool | None = Field(None, description="Return generation details.")
    do_sample: bool | None = Field(None, description="Sample instead of greedy decoding.")
    frequency_penalty: float | None = Field(None, description="In [-2, 2].")
    grammar: Grammar | None = None
    max_new_tokens: int | None = Field(None, description="Most tokens to generate (> 0).")
    repetition_penalty: float | None = Field(None, description="> 0; 1.0 means none.")
    return_full_text: bool | None = Field(None, description="Prepend the prompt to generated_text.")
    seed: int | None = Field(None, ge=0, le=2**64 - 1, description="Random seed (u64).")
    stop: Union[list[str], str, None] = Field(None, description="Stop sequences (kept in the output).")
    temperature: float | None = Field(None, description="> 0.")
    top_k: int | None = Field(None, description="> 0.")
    top_n_tokens: int | None = Field(None, description="Alternatives per generated token, 0..max_top_n_tokens.")
    top_p: float | None = Field(None, description="In (0, 1) exclusive.")
    truncate: int | None = Field(None, description="Keep only the last `truncate` prompt tokens.")
    typical_p: float | None = Field(None, description="In (0, 1) exclusive.")
    watermark: bool | None = Field(None, description="Not supported: only false / null.")


class TGIGenerateRequest(WireModel):
    """Body of TGI's ``POST /generate``, ``/generate_stream`` and ``/tokenize``."""

    inputs: Union[str, list[dict[str, Any]]] = Field(
        description="The prompt (text only; multimodal lists are rejected).")
    parameters: GenerateParameters | None = None
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens (default true).")
    stream: bool | None = Field(None, description="Ignored on /generate and /generate_stream.")


class TGICompatRequest(TGIGenerateRequest):
    """Body of TGI's ``POST /``: like /generate, plus ``stream`` choosing the reply kind."""

    stream: bool | None = Field(False, description="true: an SSE stream like /generate_stream; false: a JSON list.")
