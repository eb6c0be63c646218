"""Filling the server configuration: CLI > environment > YAML > defaults, for the server's settings
and for plugins' options.

Every setting is a long CLI flag (``max_model_len`` <-> ``--max-model-len``), a YAML key (either
spelling), and an environment variable (``LLMSERVE_MAX_MODEL_LEN``), whatever section holds it.
``load_config`` records where each value came from so ``llmserve config show`` can say it. A
backend's options model (``BackendSpec(options=...)``) is filled the same way by ``load_options``:
a YAML section named after the backend, ``LLMSERVE_<BACKEND>_<FIELD>`` variables and
``--<backend>-<field>`` flags.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from types import UnionType
from typing import Any, Mapping, Sequence, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from llmserve.config.sections import SECTION_OF, SECTIONS, ServerConfig
from llmserve.errors import ConfigError

ENV_PREFIX = "LLMSERVE_"

# Every setting, in the order of the flags in --help and of the rows of `config show` (the order
# of the flat configuration the sections were drawn from, which a section's grouping does not keep).
FIELDS = [
    "model", "mmproj", "revision", "offline", "hf_token", "served_model_name", "strict_model_name", "tokenizer",
    "generation_config", "seed", "backend", "dtype", "device", "max_model_len", "trust_remote_code",
    "allow_unverified_architecture", "task", "cache_dir", "models", "models_dir", "serve_cached_models",
    "max_loaded_models", "idle_unload_seconds", "allow_pull",
    "block_size", "num_kv_blocks", "kv_cache_memory_fraction", "kv_cache_dtype", "max_num_seqs",
    "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "speculative_config",
    "spec_draft_model", "spec_draft_n_max", "enforce_eager",
    "tensor_parallel_size", "max_concurrent_requests", "max_waiting_requests", "max_waiting_tokens",
    "max_prompt_chars", "max_logprobs", "max_stop_strings", "max_stop_chars", "strict_max_tokens", "request_timeout",
    "sse_ping_interval",
    "heap_trim_interval", "shutdown_timeout", "host", "port", "protocols", "protocol_prefix", "api_key", "root_path",
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "enable_request_id_headers", "public_metrics",
    "timeout_keep_alive", "max_request_body_bytes", "max_header_bytes", "max_header_count",
    "timeout_request_headers", "timeout_request_body", "cors_allow_origins", "cors_allow_credentials",
    "cors_allow_methods", "cors_allow_headers", "chat_template_render_timeout", "chat_template",
    "return_tokens_as_token_ids", "enable_force_include_usage", "trust_request_chat_template", "tool_call_parser",
    "enable_auto_tool_choice", "tool_parser_plugin", "reasoning_parser", "reasoning_effort_budgets",
    "reasoning_budget_message", "guided_decoding_backend",
    "guided_compile_timeout", "guided_max_bytes", "guided_max_depth", "guided_max_items",
    "allowed_media_domains", "allowed_media_networks", "media_allow_http", "allowed_local_media_path",
    "max_image_bytes", "max_image_pixels", "max_images_per_request", "media_fetch_timeout", "media_max_redirects",
    "log_level",
    "uvicorn_log_level", "disable_uvicorn_access_log", "plugins"
]
# YAML keys that are spelled differently from the field.
ALIASES = {"plugin": "plugins", "allowed_origins": "cors_allow_origins", "allowed_methods": "cors_allow_methods",
           "allowed_headers": "cors_allow_headers", "allow_credentials": "cors_allow_credentials"}
# Other spellings of a field's flag (vLLM's names for the same settings): field -> flags.
FLAG_ALIASES = {field: ["--" + key.replace("_", "-")] for key, field in ALIASES.items() if field != "plugins"}
FLAG_ALIASES["tensor_parallel_size"] = ["-tp"]  # vLLM's short spelling
FLAG_ALIASES["spec_draft_model"] = ["-md", "--model-draft"]  # llama.cpp's other spellings
FLAG_ALIASES["spec_draft_n_max"] = ["--draft-max"]


def flag_name(field: str) -> str:
    return "--plugin" if field == "plugins" else "--" + field.replace("_", "-")


def field_owner(field: str, model: type[BaseModel] = ServerConfig) -> type[BaseModel]:
    """The model that declares ``field``: ``model`` itself, or for a setting of ``ServerConfig``
    its section."""
    if model is ServerConfig and field in SECTION_OF:
        return SECTIONS[SECTION_OF[field]]
    return model


def _kind(field: str, model: type[BaseModel] = ServerConfig) -> str:
    """``list``, ``dict``, ``bool`` or ``scalar``: how a text value of the field is read."""
    ann = field_owner(field, model).model_fields[field].annotation
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


def flat_values(config: ServerConfig) -> dict[str, Any]:
    """``setting -> value`` (JSON types) of every setting, in the order of ``FIELDS``: the shape
    of ``config show`` and of the YAML file."""
    dumped = config.model_dump(mode="json")
    return {name: dumped[SECTION_OF[name]][name] if name in SECTION_OF else dumped[name] for name in FIELDS}


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
        if len(loc) > 1 and loc[0] in SECTIONS:  # a setting is named alone, not by its section
            loc = loc[1:]
        name = loc[0] if loc else "?"
        where = f" (from {sources[name]})" if sources and name in sources else ""
        msg = err["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
        ctx = err.get("ctx") or {}
        if err["type"] == "literal_error" and "expected" in ctx:
            msg = f"must be one of {ctx['expected']}"
        got = err.get("input")
        shown = f", got {got!r}" if not isinstance(got, dict) else ""
        inner = "".join(f".{p}" for p in loc[1:])  # a key inside a structured setting (--speculative-config)
        parts.append(f"{name.replace('_', '-')}{inner}: {msg}{shown}{where}")
    return "invalid configuration: " + "; ".join(parts)
