"""The server configuration: one pydantic model, filled from CLI > environment > YAML > defaults.

Every field is a long CLI flag (``max_model_len`` <-> ``--max-model-len``), a YAML key (either
spelling), and an environment variable (``LLMSERVE_MAX_MODEL_LEN``). ``load_config`` records
where each value came from so ``llmserve config show`` can say it. A backend's options model
(``BackendSpec(options=...)``) is filled the same way by ``load_options``: a YAML section named
after the backend, ``LLMSERVE_<BACKEND>_<FIELD>`` variables and ``--<backend>-<field>`` flags.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Mapping, Sequence, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmserve.errors import ConfigError

ENV_PREFIX = "LLMSERVE_"


class ServerConfig(BaseModel):
    """Everything ``llmserve serve`` can be told. Field descriptions double as CLI help."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # model
    model: str | None = Field(None, description=(
        "Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)."))
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
    # engine
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(None, ge=1, description=(
        "KV pool size in blocks (overrides --kv-cache-memory-fraction)."))
    kv_cache_memory_fraction: float = Field(0.25, gt=0.0, le=0.95, description=(
        "Fraction of free memory given to the KV pool."))
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Dtype of the KV cache: auto is the model's compute dtype; bfloat16 or float16 halve the memory per "
        "token of a float32 model's cache (keys and values are cast back to the compute dtype when read)."))
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one engine step.")
    max_num_batched_tokens: int = Field(2048, ge=16, description=(
        "Token budget of one engine step (prefill chunks + decodes)."))
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across engine steps.")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "Split the model's heads, MLP and vocabulary across this many processes (torch backend): one per GPU "
        "on CUDA (nccl), one per group of cores on the CPU (gloo). 1: one process."))
    # limits and lifecycle
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
    # server
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
    enable_request_id_headers: bool = Field(True, description=(
        "Accepted for vLLM compatibility and always on: every response carries X-Request-Id (the client's own, "
        "or a new one)."))
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
    enable_auto_tool_choice: bool = Field(False, description=(
        "Let the model decide when to call tools (tool_choice auto, the default when a request has tools); needs "
        "--tool-call-parser."))
    tool_parser_plugin: list[str] = Field(default_factory=list, description=(
        "Plugin file or module contributing tool or reasoning parsers (loaded like --plugin); repeatable."))
    reasoning_parser: str | None = Field(None, description=(
        "Reasoning parser that moves the model's thinking into reasoning_content."))
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
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    uvicorn_log_level: Literal["trace", "debug", "info", "warning", "error", "critical"] | None = Field(
        None, description="Log level of uvicorn's own loggers (default: --log-level).")
    disable_uvicorn_access_log: bool = Field(True, description=(
        "Leave uvicorn's access log off: each request's one log line is llmserve's request log "
        "(`llmserve.access`). --no-disable-uvicorn-access-log adds uvicorn's line back, query strings removed."))
    plugins: list[str] = Field(default_factory=list, description=(
        "Extra plugins: pkg.mod, pkg.mod:attr, file.py, entry-point name, or no:NAME; repeatable (CLI flag "
        "--plugin)."))

    # Options of plugins, keyed by contribution name: the YAML sections (validated once plugins
    # are loaded), the file they came from, and the values of plugin option flags.
    plugin_sections: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True)
    config_file: str | None = Field(None, exclude=True)
    plugin_flags: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True)


_PLUGIN_INPUTS = ("plugin_sections", "config_file", "plugin_flags")
FIELDS = [name for name in ServerConfig.model_fields if name not in _PLUGIN_INPUTS]
# YAML keys that are spelled differently from the field.
ALIASES = {"plugin": "plugins", "allowed_origins": "cors_allow_origins", "allowed_methods": "cors_allow_methods",
           "allowed_headers": "cors_allow_headers", "allow_credentials": "cors_allow_credentials"}
# Other spellings of a field's flag (vLLM's names for the same settings): field -> flags.
FLAG_ALIASES = {field: ["--" + key.replace("_", "-")] for key, field in ALIASES.items() if field != "plugins"}
FLAG_ALIASES["tensor_parallel_size"] = ["-tp"]  # vLLM's short spelling


def flag_name(field: str) -> str:
    return "--plugin" if field == "plugins" else "--" + field.replace("_", "-")


def _kind(field: str, model: type[BaseModel] = ServerConfig) -> str:
    """``list``, ``dict``, ``bool`` or ``scalar``: how a text value of the field is read."""
    ann = model.model_fields[field].annotation
    base = ann
    if get_origin(ann) in (Union, UnionType):  # Optional[X] -> X
        base = next(a for a in get_args(ann) if a is not type(None))
    origin = get_origin(base)
    if origin is list:
        return "list"
    if origin is dict:
        return "dict"
    if base is bool:
        return "bool"
    return "scalar"


def parse_text(field: str, value: Any, model: type[BaseModel] = ServerConfig) -> Any:
    """Turn a string from the CLI or the environment into what the field expects."""
    kind = _kind(field, model)
    if kind == "list":
        items = value if isinstance(value, (list, tuple)) else [value]
        out: list[str] = []
        for item in items:
            text = str(item).strip()
            if text.startswith("["):
                out.extend(str(x) for x in json.loads(text))
            else:
                out.extend(part.strip() for part in text.split(",") if part.strip())
        return out
    if kind == "dict":
        items = value if isinstance(value, (list, tuple)) else str(value).split(",")
        out_d: dict[str, str] = {}
        for item in items:
            key, sep, val = str(item).partition("=")
            if not sep:
                raise ConfigError(f"{field}: expected NAME=VALUE, got {item!r}")
            out_d[key.strip()] = val.strip()
        return out_d
    return value


def _normalize_key(key: str) -> str:
    name = str(key).replace("-", "_")
    return ALIASES.get(name, name)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must be a mapping of option names to values")
    return data


def load_config(cli: dict[str, Any] | None = None, config_file: str | None = None,
                environ: Mapping[str, str] | None = None) -> tuple[ServerConfig, dict[str, str]]:
    """Merge the sources and validate. Returns the config and ``field -> source``.

    ``cli`` holds only the flags the user gave (already parsed by the CLI, None = not given);
    a plugin's option flags come as ``{section: {field: value}}``. YAML keys that are not fields
    are kept in ``plugin_sections`` for plugins to validate (see ``load_options``).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in FIELDS}
    sections: dict[str, dict[str, Any]] = {}
    plugin_flags: dict[str, dict[str, Any]] = {}

    if config_file:
        for key, value in read_yaml(config_file).items():
            name = _normalize_key(key)
            if name in FIELDS:
                values[name] = parse_text(name, value) if isinstance(value, str) else value
                sources[name] = f"yaml:{config_file}"
            elif isinstance(value, dict):
                sections[str(key)] = value  # maybe a plugin's section; checked later
            else:
                raise ConfigError(unknown_key_message(str(key), config_file))
    for name in FIELDS:
        env_name = ENV_PREFIX + name.upper()
        if env.get(env_name, "") != "":
            values[name] = parse_text(name, env[env_name])
            sources[name] = f"env:{env_name}"
    for name, value in (cli or {}).items():
        if name not in FIELDS and isinstance(value, dict):
            plugin_flags[name] = {k: v for k, v in value.items() if v is not None}
            continue
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        parsed = parse_text(name, value) if isinstance(value, (str, list, tuple)) else value
        if name == "plugins" and sources[name] != "default":
            # Plugins accumulate (YAML/env first, then --plugin) instead of replacing.
            parsed = list(values.get(name) or []) + parsed
            sources[name] = f"{sources[name]}+cli"
        else:
            sources[name] = "cli"
        values[name] = parsed
    try:
        config = ServerConfig(**values)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, sources)) from None
    config.plugin_sections, config.config_file, config.plugin_flags = sections, config_file, plugin_flags
    return config, sources


def option_env(section: str, model: type[BaseModel], field: str) -> str:
    """The environment variable of a plugin option: ``LLMSERVE_<SECTION>_<FIELD>``, unless the
    model sets a class attribute ``env_prefix`` (then ``<env_prefix><FIELD>``)."""
    prefix = getattr(model, "env_prefix", None) or f"{ENV_PREFIX}{section.replace('-', '_').upper()}_"
    return prefix + field.upper()


def option_flag(section: str, field: str) -> str:
    """The CLI flag of a plugin option: ``--<section>-<field>`` with dashes."""
    return f"--{section}-{field}".replace("_", "-")


def load_options(section: str, model: type[BaseModel], config: ServerConfig,
                 environ: Mapping[str, str] | None = None) -> tuple[BaseModel, dict[str, str]]:
    """The options of the contribution ``section``, merged like the server's settings: its flags
    (``config.plugin_flags``) > its environment variables > its YAML section > the model's
    defaults. Returns the validated model and ``field -> source``; pass ``environ={}`` for
    options that only the YAML file sets."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources = {name: "default" for name in model.model_fields}
    for key, value in (config.plugin_sections.get(section) or {}).items():
        name = str(key).replace("-", "_")
        values[name] = parse_text(name, value, model) if isinstance(value, str) and name in sources else value
        sources[name] = f"yaml:{config.config_file}" if config.config_file else "yaml"
    for name in model.model_fields:
        env_name = option_env(section, model, name)
        if env.get(env_name, "") != "":
            values[name] = parse_text(name, env[env_name], model)
            sources[name] = f"env:{env_name}"
    for name, value in (config.plugin_flags.get(section) or {}).items():
        values[name] = parse_text(name, value, model) if isinstance(value, (str, list, tuple)) else value
        sources[name] = "cli"
    try:
        return model(**values), sources
    except ValidationError as exc:
        message = validation_message(exc, sources)
        raise ConfigError(message.replace("invalid configuration:", f"invalid options for '{section}':")) from None


def unknown_key_message(key: str, where: str, extra: Sequence[str] = ()) -> str:
    valid = sorted([f.replace("_", "-") for f in FIELDS] + list(extra))
    close = difflib.get_close_matches(key.replace("_", "-"), valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown config key '{key}' in {where}{hint}; valid keys: {', '.join(valid)}"


def validation_message(exc: ValidationError, sources: dict[str, str] | None = None) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        name = loc[0] if loc else "?"
        where = f" (from {sources[name]})" if sources and name in sources else ""
        msg = err["msg"]
        ctx = err.get("ctx") or {}
        if err["type"] == "literal_error" and "expected" in ctx:
            msg = f"must be one of {ctx['expected']}"
        got = err.get("input")
        shown = f", got {got!r}" if not isinstance(got, dict) else ""
        parts.append(f"{name.replace('_', '-')}: {msg}{shown}{where}")
    return "invalid configuration: " + "; ".join(parts)
