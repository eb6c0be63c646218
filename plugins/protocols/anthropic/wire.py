"""Anthropic Messages request models (``POST /v1/messages`` and ``/v1/messages/count_tokens``).

Content blocks, ``output_config`` and ``system`` blocks stay plain JSON here and are checked
block by block in ``params.py``, so an error names the exact block (``messages.2.content.1``)
and says why, instead of listing every member of a union that did not match. Unknown fields
are ignored (``metadata``-like extras such as ``service_tier`` or ``container``), as
``WireModel`` does for every dialect.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmserve import WireModel

#: How Claude Code's per-request billing block starts (the first system block, with a nonce that
#: changes on every request: kept, it makes every turn's prompt differ from its first tokens).
BILLING_PREFIX = "x-anthropic-billing-header:"


class AnthropicOptions(BaseModel):
    """Options from the ``anthropic:`` section of the YAML config."""

    model_config = ConfigDict(extra="forbid")

    billing_header: Literal["drop", "keep"] = Field(
        "drop", description="A system text block that starts with `x-anthropic-billing-header:` (Claude Code "
                            "sends one per request, its `cch=` nonce new each time): `drop` leaves it out of "
                            "the prompt, so consecutive turns share their prefix in the cache; `keep` "
                            "renders it like any system text.")


class MessageParam(WireModel):
    # "system" inside messages: agent clients (Claude Code) send them; params.chat_messages folds them
    # into the system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolParam(WireModel):
    """A client tool. ``input_schema`` is checked in ``params.py``: server tools (``type``
    ``web_search_...``, ``bash_...``) have none, and deserve a clearer 400 than "field required"."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: Any = None
    type: str | None = None


class ToolChoiceParam(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(WireModel):
    # "adaptive" and "between_tools" are the newer ways to switch thinking on; all three mean
    # "separate the model's reasoning into thinking blocks" here.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(WireModel):
    """What ``/v1/messages/count_tokens`` reads: everything that shapes the prompt."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: dict[str, Any] | None = None
    # The structured-outputs beta's spelling of output_config.format (older SDKs send it).
    output_format: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
