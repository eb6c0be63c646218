"""The server's settings as typed sections composed into ``ServerConfig``, vLLM-style.

Each section groups the settings one part of the server reads (``config.scheduler.max_num_seqs``,
``config.cache.block_size``); a consumer takes its section, not the whole configuration. The
settings keep their flat outer names: ``ServerConfig(max_num_seqs=4)``, a YAML key, a flag or an
environment variable names the setting alone and is routed to its section (``SECTION_OF``).
Field descriptions double as CLI help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmserve.config.base import Section
from llmserve.config.media import MediaConfig


# Reasoning effort -> thinking budget in tokens (--reasoning-effort-budgets overrides levels).
EFFORT_BUDGETS: dict[str, int] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                                  "xhigh": 32768}


class ModelConfig(Section):
    """The model and how it is loaded: which checkpoint, its names, dtype, device, context length, task."""

    model: str | None = Field(None, description=(
        "A local model directory or .gguf file, or a Hugging Face repo id (org/name, or org/name:QUANT for a GGUF "
        "repo) served from the local Hugging Face cache and downloaded into it when missing (default: the "
        "embedded SmolLM2-135M-Instruct)."))
    mmproj: str | None = Field(None, description=(
        "A GGUF vision model's projector file (mmproj*.gguf, as llama.cpp's converter writes it), for its images "
        "(default: the one mmproj file beside a .gguf MODEL)."))
    revision: str | None = Field(None, description=(
        "Branch, tag or commit of a Hugging Face repo MODEL (default: main)."))
    offline: bool = Field(False, description=(
        "Never download: a Hugging Face repo MODEL must already be in the local cache (as with HF_HUB_OFFLINE=1)."))
    hf_token: str | None = Field(None, description=(
        "Hugging Face token for gated or private repos (default: HF_TOKEN, or the token `hf auth login` saved)."))
    served_model_name: list[str] = Field(default_factory=list, description=(
        "Names clients may use for the model (the first is reported); repeatable."))
    strict_model_name: bool = Field(False, description=(
        "Answer 404 to a request naming a model that is not served, as vLLM does. By default, while the model "
        "has one served name, any name is accepted and answered under that name, as TGI and llama.cpp do (Hugging "
        "Face clients send placeholders such as `tgi`); with several --served-model-name an unknown one is a 404 "
        "either way."))
    tokenizer: str | None = Field(None, description=(
        "Tokenizer directory to use instead of the model's own (its chat template comes with it)."))
    generation_config: str = Field("auto", description=(
        "Where default sampling parameters come from: auto reads the model directory's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) and applies those a request "
        "leaves unset; vllm ignores the file; or a directory holding a generation_config.json."))
    seed: int | None = Field(None, ge=0, description=(
        "Server-wide random seed: requests without their own seed get one drawn from it, in arrival order, so "
        "the same requests sent in the same order after a restart get the same outputs."))
    backend: str = Field("torch", description="Backend plugin that runs the model.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weight and activation dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device to run on.")
    max_model_len: int | None = Field(None, ge=16, description=(
        "Context length (prompt + output) in tokens; default: the model's."))
    trust_remote_code: bool = Field(False, description="Allow model code from the model directory to run.")
    allow_unverified_architecture: bool = Field(False, description=(
        "Serve a model whose architecture the backend has not verified against transformers (the torch backend's "
        "list: docs/engine.md#architectures), with a warning in the execution-plan log line: its answers may be "
        "wrong. Architectures known to answer wrong (layers with a recurrent or convolution state) stay refused."))
    task: Literal["generate", "embed"] = Field("generate", description=(
        "generate: a causal LM; embed: an embedding model serving /v1/embeddings, /score and /rerank (default "
        "model: the embedded all-MiniLM-L6-v2)."))
    cache_dir: str | None = Field(None, description=(
        "Where converted GGUF weights are cached (default ~/.cache/llmserve)."))
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")


class CacheConfig(Section):
    """The KV cache: block size, pool size, dtype and prefix reuse."""

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(None, ge=1, description=(
        "KV pool size in blocks (overrides --kv-cache-memory-fraction)."))
    kv_cache_memory_fraction: float = Field(0.25, gt=0.0, le=0.95, description=(
        "Fraction of free memory given to the KV pool."))
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "q8_0", "fp8", "fp8_e4m3",
                            "fp8_e5m2"] = Field("auto", description=(
        "Dtype of the KV cache: auto is the model's compute dtype; bfloat16 or float16 halve the memory per "
        "token of a float32 model's cache (keys and values are cast back to the compute dtype when read); "
        "int8 (also q8_0, fp8, fp8_e4m3, fp8_e5m2: one 8-bit cache) keeps 8-bit codes with a scale per "
        "row, read by the native CPU kernels (a float32 model on the CPU)."))
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")


class SpeculativeConfig(BaseModel):
    """``--speculative-config``: how decode steps propose tokens for the model to verify.

    ``method`` names a proposer (``llmserve plugins`` lists them; built in: ``ngram``, prompt
    lookup). Keys beyond the common ones are the method's own: the proposer reads and checks
    them (``model_extra``), so a key no method knows fails at start."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    method: str = Field(description="The proposer: ngram (prompt lookup), or one a plugin adds.")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description=(
        "Most tokens proposed per sequence and step."))
    disable_by_batch_size: int | None = Field(None, ge=1, description=(
        "No proposals in a step with more sequences running than this (vLLM's key; default: the method's own: "
        "ngram none, draft 1 on a CPU and none on CUDA): where a step's cost grows with its rows, proposals "
        "cost more than they save in a large batch."))
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="ngram: shortest suffix matched.")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: longest suffix matched, tried first.")

    @model_validator(mode="after")
    def _ordered(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class SchedulerConfig(Section):
    """What one engine step may hold: sequences, tokens, whether prompts are split and whether
    decode steps speculate."""

    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one engine step.")
    max_num_batched_tokens: int = Field(2048, ge=16, description=(
        "Token budget of one engine step (prefill chunks + decodes)."))
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across engine steps.")
    speculative_config: SpeculativeConfig | None = Field(None, description=(
        "Speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}; the model verifies every proposed token, so the output is what it "
        "would be without. Unset: no speculation."))
    spec_draft_model: str | None = Field(None, description=(
        "A draft model for speculative decoding (a path or Hugging Face id; it must share the model's "
        "tokenizer): short for --speculative-config '{\"method\": \"draft\", \"model\": ...}', as llama.cpp "
        "spells it."))
    spec_draft_n_max: int | None = Field(None, ge=1, le=16, description=(
        "Most tokens proposed per sequence and step: the speculative config's num_speculative_tokens, as "
        "llama.cpp spells it."))

    @model_validator(mode="after")
    def _draft_flags(self) -> "SchedulerConfig":
        """llama.cpp's spellings fold into ``speculative_config``."""
        spec = self.speculative_config
        if self.spec_draft_model is not None:
            if spec is None:
                spec = SpeculativeConfig(method="draft", model=self.spec_draft_model)
            elif spec.method != "draft" or (spec.model_extra or {}).get("model", self.spec_draft_model) \
                    != self.spec_draft_model:
                raise ValueError("spec-draft-model names a draft model while speculative-config says otherwise; "
                                 "give one of them")
            else:
                spec = spec.model_copy(update={"model": self.spec_draft_model})
        if self.spec_draft_n_max is not None:
            if spec is None:
                raise ValueError("spec-draft-n-max needs a method: --spec-draft-model or --speculative-config")
            spec = spec.model_copy(update={"num_speculative_tokens": self.spec_draft_n_max})
        if spec is not self.speculative_config:  # assigned only when folded: the fields set stay what was given
            self.speculative_config = spec
        return self

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """A flag or a variable gives the JSON text; YAML gives the mapping itself."""
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else None
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        return value


class ParallelConfig(Section):
    """How the model is split across processes."""

    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Split the model's heads, MLP and vocabulary across this many processes (torch backend): one per GPU "
        "on CUDA (nccl), one per group of cores on the CPU (gloo). 1: one process."))


class LimitsConfig(Section):
    """Limits on requests and the server's lifecycle: admission, request caps, timeouts, pings, shutdown."""

    max_concurrent_requests: int | None = Field(None, ge=1, description=(
        "Most requests served at once, running or waiting (a request counts n / best_of / its prompts); more get "
        "503 with Retry-After (TGI routes: 429). Default: no limit."))
    max_waiting_requests: int | None = Field(512, ge=0, description=(
        "Most requests that may wait for a place in the running batch (beyond --max-num-seqs); more get 503 with "
        "Retry-After (TGI routes: 429). null: no limit."))
    max_waiting_tokens: int | None = Field(None, ge=1, description=(
        "Refuse new requests (503) while this many prompt tokens wait for their prefill. Default: no limit."))
    max_prompt_chars: int | None = Field(None, ge=1, description=(
        "Longest prompt text accepted, in characters, checked before tokenizing (a longer one gets 400 at once; "
        "also the cap of the tokenize routes). Default: 32 characters per token of the context length."))
    strict_max_tokens: bool = Field(False, description=(
        "Refuse (400, vLLM's behaviour) an OpenAI chat, completions or Responses request whose max_tokens is larger "
        "than the room its prompt leaves in the context. Default: cut it to the room, as Anthropic, Ollama and "
        "OpenAI's own API do (finish_reason length if the output reaches it)."))
    max_logprobs: int = Field(20, ge=0, le=20, description=(
        "Most log probabilities a request may ask for per token (logprobs, top_logprobs, prompt_logprobs); "
        "more get 400. 20 is also the server's ceiling."))
    max_stop_strings: int = Field(64, ge=0, description="Most stop strings one request may send (more: 400).")
    max_stop_chars: int = Field(32 * 1024, ge=0, description=(
        "Most characters the stop strings of one request may have in all (more: 400)."))
    request_timeout: float | None = Field(None, gt=0, description=(
        "Seconds a generation request may take in all (queue + generation); past it the request is aborted and "
        "the client gets a timeout error (in-band on streams). Default: no limit."))
    sse_ping_interval: float = Field(10.0, ge=0, description=(
        "On SSE streams, send a `: ping` comment after this many seconds without data (long prefills, queueing), "
        "so proxies keep the connection; 0: never."))
    heap_trim_interval: float = Field(10.0, ge=0, description=(
        "Seconds between checks that give freed heap memory back to the system (glibc malloc_trim) after "
        "requests, while none is open, so large requests do not leave RSS grown; 0: never."))
    shutdown_timeout: float = Field(30.0, ge=0, description=(
        "On SIGTERM: refuse new requests (503) and let in-flight ones finish for up to this many seconds, then "
        "abort the rest and exit 0; 0 aborts at once."))


class ServerHTTPConfig(Section):
    """The HTTP server: address, dialects and their prefixes, API keys, TLS, CORS, request heads and
    bodies, uvicorn's own logging."""

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind.")
    protocols: list[str] | None = Field(None, description=(
        "Dialects to serve (default: every dialect enabled by default); comma-separated or repeated."))
    protocol_prefix: dict[str, str] = Field(default_factory=dict, description=(
        "Mount a dialect under a path prefix, e.g. tgi=/tgi; repeatable."))
    api_key: list[str] = Field(default_factory=list, description=(
        "API keys clients must send (Authorization: Bearer KEY or X-Api-Key: KEY) on every route but /health, "
        "/ping, /ready and the browser pages' static files (docs/playground.md); repeatable. Empty: no "
        "authentication."))
    root_path: str = Field("", description=(
        "URL prefix under which a reverse proxy serves this server, e.g. /llm (the proxy strips it before "
        "forwarding); /openapi.json names it as the server's URL."))
    ssl_keyfile: str | None = Field(None, description="Private key file (PEM): serve HTTPS with --ssl-certfile.")
    ssl_certfile: str | None = Field(None, description="Certificate chain file (PEM): serve HTTPS with --ssl-keyfile.")
    ssl_ca_certs: str | None = Field(None, description=(
        "CA certificates file (PEM) used to verify client certificates (with --ssl-cert-reqs)."))
    ssl_cert_reqs: int = Field(0, ge=0, le=2, description=(
        "Whether HTTPS clients must present a certificate: 0 no, 1 optional, 2 required (Python's ssl.CERT_*)."))
    enable_request_id_headers: bool = Field(False, description=(
        "Add X-Request-Id to every response (the client's own when it sent a plain one, else a new id), as vLLM "
        "does with this flag; off, responses carry none (the id is still logged and given to the route)."))
    public_metrics: bool = Field(False, description=(
        "Serve GET /metrics without an API key (by default it needs one when --api-key is set)."))
    timeout_keep_alive: float = Field(5.0, gt=0, description=(
        "Seconds an idle HTTP keep-alive connection stays open. Behind a load balancer or proxy that pools "
        "connections, set it above the proxy's idle timeout, or the proxy may reuse a connection just as the "
        "server closes it."))
    max_request_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description=(
        "Largest request body accepted, in bytes; bigger bodies get 413."))
    max_header_bytes: int = Field(65536, ge=4096, description=(
        "Largest request line plus headers, in bytes; more gets 431 (414 for the URL alone) before the rest is "
        "read."))
    max_header_count: int = Field(256, ge=16, description="Most headers in one request; more gets 431.")
    timeout_request_headers: float = Field(30.0, gt=0, description=(
        "Seconds a client has to send a request's line and headers (from the connection's opening, or the "
        "request's first byte on a kept-alive connection); slower or silent connections are closed (408 when a "
        "request had begun). Also bounds how long the rest of a body is read and dropped after an early answer "
        "such as a 413."))
    timeout_request_body: float = Field(60.0, gt=0, description=(
        "Seconds a client has to send a request's body once its headers are in; a slower upload gets 408 and the "
        "connection closes."))
    cors_allow_origins: list[str] = Field(default_factory=list, description=(
        "Origins browsers may call from (CORS), e.g. https://app.example.com, or * for any; repeatable. Empty: "
        "CORS off."))
    cors_allow_credentials: bool = Field(False, description=(
        "Let browsers send cookies and Authorization headers cross-origin (CORS); not allowed with origin *."))
    cors_allow_methods: list[str] = Field(["GET", "POST", "OPTIONS"], description=(
        "HTTP methods browsers may use cross-origin (CORS), or * for any; repeatable."))
    cors_allow_headers: list[str] = Field(["*"], description=(
        "Request headers browsers may send cross-origin (CORS), or * for any; repeatable."))
    uvicorn_log_level: Literal["trace", "debug", "info", "warning", "error", "critical"] | None = Field(
        None, description="Log level of uvicorn's own loggers (default: --log-level).")
    disable_uvicorn_access_log: bool = Field(True, description=(
        "Leave uvicorn's access log off: each request's one log line is llmserve's request log "
        "(`llmserve.access`). --no-disable-uvicorn-access-log adds uvicorn's line back, query strings removed."))


class ParsingConfig(Section):
    """Chat templates, tool-call and reasoning parsers, and what the outputs carry."""

    chat_template_render_timeout: float = Field(5.0, gt=0, le=600, description=(
        "Seconds a chat template may take to render before the request fails with 400."))
    chat_template: str | None = Field(None, description=(
        "Chat template to use instead of the model's own: a file path or the template text (e.g. a template "
        "that renders `tools` when the model's drops them)."))
    return_tokens_as_token_ids: bool = Field(False, description=(
        "In OpenAI logprobs, name each token `token_id:ID` instead of its text (so tokens that are not valid "
        "UTF-8 on their own stay identifiable); a request's own return_tokens_as_token_ids overrides it."))
    enable_force_include_usage: bool = Field(False, description=(
        "Send the usage chunk at the end of every OpenAI stream, as if each request set "
        "stream_options.include_usage."))
    trust_request_chat_template: bool = Field(False, description="Allow requests to send their own chat_template.")
    tool_call_parser: str | None = Field(None, description=(
        "Tool-call parser that turns model output into tool_calls (see `llmserve plugins`)."))
    enable_auto_tool_choice: bool | None = Field(None, description=(
        "Let the model decide when to call tools (tool_choice auto, the default when a request has tools). Not "
        "given: on when a tool-call parser is named or the model's chat template shows a tool-call format one "
        "reads (detected at start, as llama.cpp and Ollama do); given: also detects the reasoning parser; "
        "--no-enable-auto-tool-choice: off (vLLM's default)."))
    tool_parser_plugin: list[str] = Field(default_factory=list, description=(
        "Plugin file or module contributing tool or reasoning parsers (loaded like --plugin); repeatable."))
    reasoning_parser: str | None = Field(None, description=(
        "Reasoning parser that moves the model's thinking into reasoning_content."))
    reasoning_effort_budgets: dict[str, int] = Field(default_factory=lambda: dict(EFFORT_BUDGETS), description=(
        "Thinking budget in tokens of each reasoning effort (OpenAI reasoning_effort, Responses reasoning.effort, "
        "Anthropic output_config.effort, Ollama think levels), e.g. low=512,high=8192; the levels given replace "
        "those of the default table (docs/tool-calling.md#thinking-budgets)."))
    reasoning_budget_message: str = Field("", description=(
        "Text the engine writes before the reasoning parser's end marker when a thinking budget is spent (e.g. "
        "\"Time is up: answer now.\"); it counts against the budget and is left out when it does not fit."))

    @field_validator("reasoning_effort_budgets")
    @classmethod
    def _known_efforts(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(EFFORT_BUDGETS))
        if unknown:
            raise ValueError(f"unknown reasoning effort {unknown[0]!r} (known: {', '.join(EFFORT_BUDGETS)})")
        bad = next((k for k, v in value.items() if v < 0), None)
        if bad is not None:
            raise ValueError(f"the budget of {bad!r} must be a number of tokens >= 0, got {value[bad]}")
        return {**EFFORT_BUDGETS, **value}


class GuidedConfig(Section):
    """Guided decoding: the preferred plugin and the bounds on one output constraint."""

    guided_decoding_backend: str = Field("lm-format-enforcer", description=(
        "Guided-decoding plugin preferred for guided_json / guided_regex / guided_choice / guided_grammar / "
        "response_format (another installed one is used for kinds it does not support)."))
    guided_compile_timeout: float = Field(10.0, gt=0, le=600, description=(
        "Seconds one output constraint (JSON schema, regex, choice list) may take to compile; past it the "
        "request gets 400 and the constraint is remembered as too slow."))
    guided_max_bytes: int = Field(65536, ge=256, description=(
        "Largest output constraint, in bytes (a regex also once its counted repetitions are written out); "
        "larger ones get 400."))
    guided_max_depth: int = Field(64, ge=4, le=1000, description=(
        "Deepest nesting of objects and arrays in a JSON-schema constraint, and of groups in a regex; deeper "
        "ones get 400."))
    guided_max_items: int = Field(1024, ge=16, description=(
        "Most items in one part of an output constraint (choices, enum values, properties, anyOf branches, "
        "alternatives of a regex group); more get 400."))


class RouterConfig(Section):
    """More models beside MODEL, loaded when a request names them, and when they are unloaded."""

    models: list[str | dict[str, Any]] = Field(default_factory=list, description=(
        "Another model to serve beside MODEL (a path or Hugging Face id, optionally NAME=SOURCE), loaded when a "
        "request names it; repeatable. In YAML an entry may be a mapping with the model's own settings: model, "
        "served_model_name, revision, dtype, max_model_len, num_kv_blocks, kv_cache_dtype."))
    models_dir: str | None = Field(None, description=(
        "Serve every .gguf file and model directory in this folder as well, named by its file name, loaded on "
        "demand."))
    serve_cached_models: bool = Field(False, description=(
        "Serve every model in the local Hugging Face cache as well (see `llmserve ls`), loaded on demand."))
    max_loaded_models: int | None = Field(None, ge=1, description=(
        "Most models loaded on demand at once, beside MODEL (which stays loaded); loading one more unloads the "
        "least recently used idle one. Default: no limit but memory."))
    allow_pull: bool = Field(False, description=(
        "Let Ollama's /api/pull fetch a Hugging Face model (org/name[:QUANT], or hf.co/org/name[:QUANT]) into "
        "the local cache and serve it, loaded on its first request. Needs --api-key: a pull fills the disk. "
        "Default: /api/pull is refused."))
    idle_unload_seconds: float | None = Field(None, ge=0, description=(
        "Unload a model loaded on demand once it has been idle this long (an Ollama request's keep_alive "
        "overrides it). Default: keep it loaded."))

    @field_validator("models")
    @classmethod
    def _check_entries(cls, value: list[Any]) -> list[Any]:
        for entry in value:
            if isinstance(entry, dict):
                unknown = sorted(set(entry) - MODEL_ENTRY_KEYS)
                if unknown:
                    raise ValueError(f"unknown key {unknown[0]!r} in a models entry (known: "
                                     f"{', '.join(sorted(MODEL_ENTRY_KEYS))})")
                if not isinstance(entry.get("model"), str) or not entry["model"]:
                    raise ValueError("a models entry needs `model`: a path or Hugging Face id")
        return value


# The settings one entry of `models:` may give for its own model (the rest are the server's).
MODEL_ENTRY_KEYS = frozenset({"model", "served_model_name", "revision", "dtype", "max_model_len", "num_kv_blocks",
                              "kv_cache_dtype"})

# Section attribute of ServerConfig -> its model, in the order the sections are composed.
SECTIONS: dict[str, type[Section]] = {
    "llm": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
    "limits": LimitsConfig, "http": ServerHTTPConfig, "parsing": ParsingConfig, "guided": GuidedConfig,
    "router": RouterConfig, "media": MediaConfig,
}
# Setting -> the section attribute that holds it (the settings outside sections are ServerConfig's own).
SECTION_OF: dict[str, str] = {field: name for name, model in SECTIONS.items() for field in model.model_fields}


class ServerConfig(BaseModel):
    """Everything ``llmserve serve`` can be told: the sections, plus the two process-wide settings
    (the log level and the plugin list, which the loader needs before any section matters).

    Flat keyword arguments name settings and go to their sections, so ``ServerConfig(port=9000,
    max_num_seqs=4)`` and ``ServerConfig(http=ServerHTTPConfig(port=9000))`` are the same kind of
    value. Reading a setting flat (``config.port``) still works for plugins written against the
    flat configuration, but the type checker sees only the sections: the code here reads
    ``config.http.port``.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    llm: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    http: ServerHTTPConfig = Field(default_factory=ServerHTTPConfig)
    parsing: ParsingConfig = Field(default_factory=ParsingConfig)
    guided: GuidedConfig = Field(default_factory=GuidedConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    media: MediaConfig = Field(default_factory=MediaConfig)
    # The process's own settings: every process logs, and plugins load before any section is read.
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    plugins: list[str] = Field(default_factory=list, description=(
        "Extra plugins: pkg.mod, pkg.mod:attr, file.py, entry-point name, or no:NAME; repeatable (CLI flag "
        "--plugin)."))

    # Options of plugins, keyed by contribution name: the YAML sections (validated once plugins
    # are loaded), the file they came from, and the values of plugin option flags.
    plugin_sections: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True)
    config_file: str | None = Field(None, exclude=True)
    plugin_flags: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _route_flat_settings(cls, data: Any) -> Any:
        """Move each flat setting into its section; a flat setting wins over the same one given in
        a section."""
        if not isinstance(data, Mapping):
            return data
        routed: dict[str, Any] = {}
        flat: dict[str, dict[str, Any]] = {}
        for key, value in data.items():
            section = SECTION_OF.get(key)
            if section is None:
                routed[key] = value
            else:
                flat.setdefault(section, {})[key] = value
        for section, values in flat.items():
            given = routed.get(section)
            if isinstance(given, BaseModel):
                given = given.model_dump(exclude_unset=True)
            if given is None or isinstance(given, Mapping):
                routed[section] = {**(given or {}), **values}
            # else: the section itself is malformed, and validating it says so
        return routed

    if not TYPE_CHECKING:
        # Kept out of the type checker's sight on purpose: it must flag a flat read in this code.
        def __getattr__(self, name: str) -> Any:
            section = SECTION_OF.get(name)
            if section is not None:
                return getattr(getattr(self, section), name)
            return super().__getattr__(name)
