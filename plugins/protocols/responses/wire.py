"""Responses API request models and the ``responses:`` options section.

Unknown keys are ignored (clients send fields of newer API versions), explicit nulls mean
"default", NaN and Infinity are refused (``dialect_kit.WireModel``). Items of ``input`` stay
plain dicts here: ``items.py`` reads each by its ``type`` and names the one that is wrong.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from llmserve import WireModel


class ResponsesOptions(BaseModel):
    """Options from the ``responses:`` section of the YAML config."""

    model_config = ConfigDict(extra="forbid")

    store: bool = Field(False, description="Keep responses in memory for previous_response_id, GET and DELETE "
                                           "/v1/responses/{id}. Off: the server is stateless.")
    store_max_responses: int = Field(1000, ge=1, description="Most responses kept per API key (all clients "
                                                             "share one budget when no keys are set).")
    store_max_bytes: int = Field(64 * 1024 * 1024, ge=1024,
                                 description="Most bytes of JSON kept per API key; the least recently used "
                                             "responses are dropped first.")


class TextConfig(WireModel):
    format: dict[str, Any] | None = Field(None, description="{type: text | json_object | json_schema "
                                                            "(name, schema, strict)}: the output's shape.")
    verbosity: str | None = Field(None, description="Accepted and ignored.")


class ReasoningConfig(WireModel):
    effort: str | None = Field(None, description="none | minimal | low | medium | high | xhigh; given to the "
                                                 "chat template as reasoning_effort, and the thinking budget "
                                                 "of that effort is enforced (--reasoning-effort-budgets).")
    summary: str | None = Field(None, description="Accepted and ignored (reasoning comes back whole).")
    generate_summary: str | None = Field(None, description="Accepted and ignored.")


class ResponsesRequest(WireModel):
    """Body of ``POST /v1/responses``."""

    model: str | None = None
    input: Union[str, list[dict[str, Any]], None] = Field(
        None, description="A user message, or a list of items: message, function_call, function_call_output, "
                          "reasoning.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools ({type: function, name, "
                                                                 "parameters, strict, description}).")
    tool_choice: Union[str, dict[str, Any], None] = Field(
        None, description="none | auto | required | {type: function, name} | {type: allowed_tools, mode, tools}.")
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, description="Most tokens to generate (>= 1).")
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(None, description="Keep the response (default true when the server's store is "
                                                 "on; without a store the reply says false).")
    previous_response_id: str | None = Field(None, description="Continue after a stored response.")
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = Field(None, description=(
        "`message.output_text.logprobs` returns the answer's token logprobs; other values are accepted and ignored."))
    truncation: str | None = Field(None, description="auto | disabled; accepted, nothing is truncated.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Most likely alternatives per token in the logprobs (0-20); giving it returns logprobs as well."))
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = Field(None, description="Accepted and ignored.")
    stream_options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    # Refused: features this server does not have, answered with a 400 naming them.
    background: bool | None = Field(None, description=(
        "Answer at once with a queued response and generate on (needs the response store): poll it with GET, "
        "stream its events again with GET ?stream=true&starting_after=N, stop it with POST .../cancel."))
    conversation: Any = Field(None, description="Refused: no Conversations API (use previous_response_id).")
    prompt: Any = Field(None, description="Refused: no stored prompt templates.")
    # Other dialects' constraint spellings: refused rather than ignored, so a constraint never
    # fails open (the Responses spelling is text.format).
    response_format: Any = Field(None, description="Refused: use text.format.")
    structured_outputs: Any = Field(None, description="Refused: use text.format.")
    guided_json: Any = Field(None, description="Refused: use text.format.")
    guided_regex: Any = Field(None, description="Refused: use text.format.")
    guided_choice: Any = Field(None, description="Refused: use text.format.")
    guided_grammar: Any = Field(None, description="Refused: use text.format.")
