"""OpenAI request models. Unknown fields are ignored (real clients send vLLM, FastDeploy and
TGI extras), explicit nulls mean "default", NaN and Infinity are refused (``dialect_kit.WireModel``)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from llmserve import InvalidRequestError
from llmserve import WireModel


class StreamOptions(WireModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(WireModel):
    """Fields shared by chat and completions (OpenAI + vLLM + FastDeploy extras)."""

    model: str | None = None
    n: int | None = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int | None = None
    return_token_ids: bool | None = None
    temp_scaled_logprobs: bool | None = None
    top_p_normalized_logprobs: bool | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    structural_tag: Any = None
    metadata: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_guided_keys(cls, data: Any) -> Any:
        """An output constraint this server does not know must not be dropped like other unknown
        fields (the reply would be unconstrained): ``guided_*`` keys it lacks are a 400."""
        if isinstance(data, dict):
            unknown = [k for k in data if isinstance(k, str) and k.startswith("guided_")
                       and k not in cls.model_fields and data[k] is not None]
            if unknown:
                raise InvalidRequestError(f"{unknown[0]}: unknown guided-decoding field; supported: guided_json, "
                                          "guided_regex, guided_choice, guided_grammar, guided_decoding_backend "
                                          "or structured_outputs", param=unknown[0])
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        """OpenAI and vLLM refuse ``stream_options`` (but not an empty one) on a request that does
        not stream; after validation, so a bad value inside it is named first."""
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise InvalidRequestError("Stream options can only be defined when `stream=True`.",
                                      param="stream_options")
        return self

    @model_validator(mode="before")
    @classmethod
    def _prompt_logprobs_rules(cls, data: Any) -> Any:
        """vLLM's rules: -1 (the whole vocabulary) or a count, and none while streaming."""
        value = data.get("prompt_logprobs") if isinstance(data, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            if data.get("stream") and (value > 0 or value == -1):
                raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.",
                                          param="prompt_logprobs")
            if value < -1:
                raise InvalidRequestError("`prompt_logprobs` must be a positive value or -1.",
                                          param="prompt_logprobs")
        return data


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    add_special_tokens: bool | None = True
    response_format: ResponseFormat | None = None


class ChatMessage(WireModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    disable_chat_template: bool | None = False
    prompt_token_ids: list[int] | None = None
    documents: list[dict[str, Any]] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    include_reasoning: bool | None = True
    reasoning_effort: str | None = None
    thinking_budget: int | None = Field(None, ge=0)

    @field_validator("prompt_token_ids")
    @classmethod
    def _some_prompt_ids(cls, ids: list[int] | None) -> list[int] | None:
        # An empty list is not "no list": left as is, it would fall back to rendering `messages`,
        # answering a request that asked for a prompt of no tokens.
        if ids is not None and not ids:
            raise ValueError("must not be empty (leave it out to render `messages`)")
        return ids

    @model_validator(mode="before")
    @classmethod
    def _one_way_to_end_the_prompt(cls, data: Any) -> Any:
        """The template either opens a new assistant turn or continues the last message, not both
        (vLLM, transformers and llama.cpp refuse the pair)."""
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                      "True.", param="continue_final_message")
        return data
