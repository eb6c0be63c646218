"""vLLM-native request model (``POST /generate`` with ``prompt``) and the ``vllm_native:``
options section. Ranges are checked in ``params.py``, in vLLM's wording."""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmserve import InvalidRequestError
from llmserve import WireModel


class VLLMNativeOptions(BaseModel):
    """Options from the ``vllm_native:`` section of the YAML config."""

    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int | None = Field(
        16, ge=1, description="max_tokens when a request gives none (vLLM's SamplingParams default: 16; "
                              "null: up to the context length).")


class VLLMGenerateRequest(WireModel):
    """Body of vLLM-native ``POST /generate``. Unknown keys are ignored; nulls mean the default."""

    prompt: Union[str, list[dict[str, Any]]] = Field(
        description="The prompt, as the model reads it (a vision model's: one image placeholder per image in "
                    "`multi_modal_data`; multimodal lists are rejected).")
    multi_modal_data: dict[str, Any] | None = Field(
        None, description="{\"image\": one image or a list}: each an http(s), file or data: URL, or base64; "
                          "in the order of the prompt's placeholders (a vision model's).")
    stream: bool | None = Field(False, description="true: `\\0`-separated JSON records instead of one JSON object.")
    n: int | None = Field(None, description="Sequences returned (default 1).")
    best_of: int | None = Field(None, description="Sequences generated; the n most likely are returned.")
    max_tokens: int | None = Field(None, description="Most tokens to generate per sequence (default 16).")
    min_tokens: int | None = Field(None, description="Generate at least this many tokens before EOS/stop.")
    temperature: float | None = Field(None, description=">= 0; 0 is greedy (default 1.0).")
    top_p: float | None = Field(None, description="In (0, 1] (default 1.0).")
    top_k: int | None = Field(None, description="-1 (off) or >= 1.")
    min_p: float | None = Field(None, description="In [0, 1].")
    repetition_penalty: float | None = Field(None, description="In (0, 2] (default 1.0).")
    presence_penalty: float | None = Field(None, description="In [-2, 2] (default 0).")
    frequency_penalty: float | None = Field(None, description="In [-2, 2] (default 0).")
    seed: int | None = Field(None, description="Random seed, 0 .. 2^64-1.")
    stop: Union[str, list[str], None] = Field(None, description="Stop strings (1+ characters each, 32768 in all).")
    stop_token_ids: list[int] | None = Field(None, description="Stop token ids (ids outside int32 are ignored).")
    bad_words: list[str] | None = Field(None, description="Words never generated.")
    include_stop_str_in_output: bool | None = Field(None, description="Keep the matched stop string (default false).")
    skip_special_tokens: bool | None = Field(None, description="Drop special tokens from the text (default true).")
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool | None = Field(None, description="Keep generating after EOS (default false).")
    model: str | None = Field(None, description="LoRA id in MindIE: null, \"None\" or a served model name.")
    use_beam_search: bool | None = Field(None, description="Not supported: only false / null.")
    structured_outputs: dict[str, Any] | None = Field(None, description=(
        "Output constraint, vLLM's StructuredOutputsParams: exactly one of json, regex, choice, json_object "
        "(grammar and structural_tag are refused)."))
    guided_decoding: dict[str, Any] | None = Field(None, description="Older name of structured_outputs.")
    guided_json: Any = Field(None, description="JSON schema the output follows (legacy spelling).")
    guided_regex: str | None = Field(None, description="Regular expression the output matches (legacy spelling).")
    guided_choice: list[str] | None = Field(None, description="The output is one of these (legacy spelling).")
    guided_grammar: str | None = Field(None, description="Refused: no installed decoder supports grammars.")
    guided_decoding_backend: str | None = Field(None, description="Guided decoder to use (auto or an installed one).")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_guided_keys(cls, data: Any) -> Any:
        """An unknown ``guided_*`` key is a 400, never dropped (the output would be unconstrained)."""
        if isinstance(data, dict):
            unknown = [k for k in data if isinstance(k, str) and k.startswith("guided_")
                       and k not in cls.model_fields and data[k] is not None]
            if unknown:
                raise InvalidRequestError(f"{unknown[0]}: unknown guided-decoding field", param=unknown[0])
        return data
