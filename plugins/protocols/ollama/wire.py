"""Ollama request models (``/api/chat``, ``/api/generate``, ``/api/embed``, ...).

The ``ollama`` client sends every field it has, empty strings included (``suffix: ""``,
``system: ""``, ``tools: []``), so empty values mean "absent" throughout. Unknown keys are
ignored, as Ollama does; NaN and Infinity are refused (``dialect_kit.WireModel``).
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field

from llmserve import WireModel

#: ``format``: "" (none), "json", or a JSON schema object.
Format = Union[str, dict[str, Any], None]
#: ``think``: true / false, or a level ("low", "medium", "high").
Think = Union[bool, str, None]
#: ``keep_alive``: a duration ("5m") or seconds: how long the model stays loaded once idle (0: unload it
#: when the request ends; negative: keep it). The server's default model always stays loaded.
KeepAlive = Union[str, float, None]


class Options(WireModel):
    """``options``: the Modelfile parameters a request may override (docs/ollama.md lists what
    each one does here). Load-time options are accepted and ignored: the server is configured
    once, at start-up."""

    # runtime options
    num_keep: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    stop: Union[list[str], str, None] = None
    # load-time options
    num_ctx: int | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None


class ToolCallFunction(WireModel):
    name: str
    arguments: Union[dict[str, Any], str, None] = None
    index: int | None = None


class ToolCall(WireModel):
    id: str | None = None
    function: ToolCallFunction


class Message(WireModel):
    """One chat message; ``tool`` messages name their tool with ``tool_name``."""

    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class _Generation(WireModel):
    model: str | None = Field(None, description="`name[:tag]`; `:latest` is the default tag.")
    stream: bool | None = Field(None, description="NDJSON stream (default true).")
    options: Options | None = None
    format: Format = Field(None, description='"json" or a JSON schema: guided decoding.')
    think: Think = Field(None, description='true/false or "low"/"medium"/"high": needs --reasoning-parser.')
    keep_alive: KeepAlive = None
    logprobs: bool | None = Field(None, description="Not supported: only false / null.")
    top_logprobs: int | None = Field(None, description="Not supported: only 0 / null.")


class ChatRequest(_Generation):
    """Body of ``POST /api/chat``."""

    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools: needs --enable-auto-tool-choice "
                                                                 "and --tool-call-parser.")


class GenerateRequest(_Generation):
    """Body of ``POST /api/generate``."""

    prompt: str | None = None
    suffix: str | None = Field(None, description="Fill-in-the-middle: not supported (only empty).")
    system: str | None = None
    template: str | None = Field(None, description="A Go template: .System, .Prompt, .Response, if/else/end.")
    context: list[int] | None = Field(None, description="Token ids of the previous exchange (from `context`).")
    raw: bool | None = Field(None, description="Send the prompt as is: no template.")
    images: list[Any] | None = Field(None, description="Base64 images (docs/images.md); a text-only model answers 400.")


class EmbedRequest(WireModel):
    """Body of ``POST /api/embed``."""

    model: str | None = None
    input: Union[str, list[str], None] = None
    truncate: bool | None = Field(None, description="Cut inputs to the context length (default true).")
    dimensions: int | None = Field(None, description="Keep the first N dimensions, renormalized.")
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(WireModel):
    """Body of the legacy ``POST /api/embeddings``."""

    model: str | None = None
    prompt: str | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


class ModelRequest(WireModel):
    """Body of ``POST /api/show`` (``name`` is the older spelling of ``model``)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


class ManagementRequest(WireModel):
    """Bodies of the model-management routes: read only to be refused, but for ``/api/pull`` on a
    server started with ``--allow-pull`` (``model``/``name``, ``stream``)."""

    model: str | None = None
    name: str | None = None
    source: str | None = None
    destination: str | None = None
    stream: bool | None = None
