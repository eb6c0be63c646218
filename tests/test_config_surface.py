"""The configuration's outer names stay put: every setting's flags, environment variable and YAML
spellings, the values each one yields and the ``config show`` listing equal a snapshot
(tests/config_surface.json) taken from the flat configuration before it was split into sections.

Rewrite the snapshot only for a deliberate change of a name:
``.venv/bin/python -c "import sys; sys.path[:0] = ['tests']; import test_config_surface as t; t.write_snapshot()"``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import typer.main

from conftest import run_cli
from llmserve.cli import cli
from llmserve.config import ALIASES, ENV_PREFIX, FIELDS, flat_values, load_config

SNAPSHOT = Path(__file__).resolve().parent / "config_surface.json"

# A valid value, as text, for every setting: unlike the defaults, each one shows that the
# source reached its setting.
SAMPLES = {
    "model": "/models/m", "mmproj": "/models/mmproj-m.gguf", "revision": "v1.0", "offline": "true",
    "hf_token": "hf_sample",
    "served_model_name": "a,b", "strict_model_name": "true", "tokenizer": "/tok",
    "generation_config": "vllm", "seed": "7", "backend": "echo", "dtype": "float32", "device": "cpu",
    "max_model_len": "1024", "trust_remote_code": "true", "allow_unverified_architecture": "true",
    "task": "embed", "cache_dir": "/cache", "models": "b=/models/b,org/c", "models_dir": "/models",
    "serve_cached_models": "true", "max_loaded_models": "2", "idle_unload_seconds": "300",
    "allow_pull": "true", "block_size": "32",
    "num_kv_blocks": "99",
    "kv_cache_memory_fraction": "0.5", "kv_cache_dtype": "float16", "max_num_seqs": "5",
    "max_num_batched_tokens": "4096", "enable_prefix_caching": "false", "enable_chunked_prefill": "false",
    "speculative_config": '{"method": "draft", "num_speculative_tokens": 3}', "spec_draft_model": "org/draft",
    "spec_draft_n_max": "5",
    "enforce_eager": "true", "tensor_parallel_size": "2", "max_concurrent_requests": "9",
    "max_waiting_requests": "11", "max_waiting_tokens": "1000", "max_prompt_chars": "5000", "max_logprobs": "3",
    "max_stop_strings": "4", "max_stop_chars": "100", "strict_max_tokens": "true", "request_timeout": "12.5",
    "sse_ping_interval": "2",
    "heap_trim_interval": "3", "shutdown_timeout": "4", "host": "0.0.0.0", "port": "9000",
    "protocols": "openai,ops", "protocol_prefix": "tgi=/tgi", "api_key": "k1,k2", "root_path": "/llm",
    "ssl_keyfile": "/k.pem", "ssl_certfile": "/c.pem", "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "2",
    "enable_request_id_headers": "true", "public_metrics": "true", "timeout_keep_alive": "7",
    "max_request_body_bytes": "4096", "max_header_bytes": "8192", "max_header_count": "32",
    "timeout_request_headers": "9", "timeout_request_body": "10", "cors_allow_origins": "https://a.example",
    "cors_allow_credentials": "true", "cors_allow_methods": "GET", "cors_allow_headers": "X-A,X-B",
    "chat_template_render_timeout": "6", "chat_template": "{{ x }}", "return_tokens_as_token_ids": "true",
    "enable_force_include_usage": "true", "trust_request_chat_template": "true", "tool_call_parser": "hermes",
    "enable_auto_tool_choice": "true", "tool_parser_plugin": "p.q", "reasoning_parser": "qwen3",
    "reasoning_effort_budgets": "low=512,high=8192", "reasoning_budget_message": "Time is up.",
    "guided_decoding_backend": "outlines", "guided_compile_timeout": "3", "guided_max_bytes": "1024",
    "guided_max_depth": "8", "guided_max_items": "64", "allowed_media_domains": "images.example,*.cdn.example",
    "allowed_media_networks": "10.0.0.0/8", "media_allow_http": "true", "allowed_local_media_path": "/media",
    "max_image_bytes": "2048", "max_image_pixels": "1000000", "max_images_per_request": "3",
    "media_fetch_timeout": "4.5", "media_max_redirects": "2", "log_level": "debug", "uvicorn_log_level": "trace",
    "disable_uvicorn_access_log": "false", "plugins": "a.b",
}


def flags_of(command: str) -> dict[str, list[str]]:
    """``parameter -> its option strings`` of a command (``config show`` as ``config show``)."""
    group: Any = typer.main.get_command(cli)
    found = group
    for part in command.split():
        found = found.commands[part]
    return {p.name: sorted([*p.opts, *p.secondary_opts]) for p in found.params if p.name in FIELDS}


def show(*args: str, env: dict[str, str] | None = None) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    out = run_cli("config", "show", *args, env={**clean, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def settings_only(text: str) -> list[list[str]]:
    """``[name, value, source]`` of each line of ``config show`` for a server setting. A backend's
    ``<backend>.<option>`` rows belong to its options model and change with it (and the longest
    name sets the column width, so the padding is left out)."""
    rows = [re.fullmatch(r"(\S+)\s+(.*?)\s+(\S+)", line) for line in text.splitlines()]
    return [list(row.groups()) for row in rows if row and "." not in row.group(1)]


def surface(tmp_path: Path) -> dict[str, Any]:
    """Everything outside code sees of the configuration, read from the live code."""
    env = {ENV_PREFIX + name.upper(): SAMPLES[name] for name in FIELDS}
    by_env, env_sources = load_config(None, None, environ=env)
    # YAML: the dashed spelling, the underscored one and the other names (ALIASES), one file each
    spellings: dict[str, list[str]] = {name: [name, name.replace("_", "-")] for name in FIELDS}
    for alias, name in ALIASES.items():
        spellings[name].append(alias)
    yaml_values: dict[str, list[Any]] = {}
    for index in range(max(len(keys) for keys in spellings.values())):
        path = tmp_path / f"spelling{index}.yaml"
        path.write_text("".join(f"{keys[index]}: {json.dumps(SAMPLES[name])}\n"
                                for name, keys in spellings.items() if index < len(keys)))
        config, sources = load_config(None, str(path), environ={})
        dumped = flat(config)
        for name, keys in spellings.items():
            if index < len(keys):
                assert sources[name] == f"yaml:{path}", (name, sources[name])
                yaml_values.setdefault(name, []).append(dumped[name])
    cli_sample = ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--api-key", "s", "-tp", "2",
                  "--allowed-origins", "https://b.example", "--plugin", "x.y", "--protocol-prefix", "tgi=/t"]
    return {
        "fields": list(FIELDS),
        "flags": {command: flags_of(command) for command in ("serve", "config show", "warmup")},
        "env": {name: [ENV_PREFIX + name.upper(), env_sources[name]] for name in FIELDS},
        "env_values": flat(by_env),
        "yaml_spellings": spellings,
        "yaml_values": yaml_values,
        "show_defaults": settings_only(show()),
        "show_cli": settings_only(show(*cli_sample, env={"LLMSERVE_PORT": "9001"})),
        "show_json": {k: v for k, v in json.loads(show("--json", *cli_sample)).items() if "." not in k},
    }


def flat(config: Any) -> dict[str, Any]:
    """``field -> value`` (JSON types) of a config, in the order of FIELDS."""
    return flat_values(config)


def test_names_values_and_config_show_equal_the_snapshot(tmp_path):
    expected = json.loads(SNAPSHOT.read_text())
    current = json.loads(json.dumps(surface(tmp_path)))
    for key in expected:
        assert current[key] == expected[key], key
    assert set(current) == set(expected)


def write_snapshot() -> None:
    with tempfile.TemporaryDirectory() as folder:
        SNAPSHOT.write_text(json.dumps(surface(Path(folder)), indent=1) + "\n")
