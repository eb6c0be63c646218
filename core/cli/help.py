"""``--help`` of the commands that take the server's settings: flags grouped into panels, defaults
shown, plain text that wraps to any terminal width and never cuts a flag name.

``PANELS`` places every ``ServerConfig`` field (a test holds every field to having one); flags of
backend options go to ``BACKEND_PANEL``.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import typer.core
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MODEL, ENGINE, LIMITS, SERVER = "Model", "Engine", "Limits and lifecycle", "Server"
SECURITY, TEMPLATES, TOOLS, GUIDED = "Security", "Chat templates and outputs", "Tools and parsers", "Guided decoding"
PLUGINS, LOGGING, BACKEND_PANEL, SCALE = "Plugins", "Logging", "Backend options", "Scale-out"
GENERAL, MEDIA = "General", "Images in requests"

# Panels in the order --help shows them.
ORDER = [GENERAL, MODEL, ENGINE, LIMITS, SERVER, SECURITY, MEDIA, TEMPLATES, TOOLS, GUIDED, PLUGINS, LOGGING,
         BACKEND_PANEL, SCALE]

PANELS: dict[str, str] = {
    # model
    "model": MODEL, "mmproj": MODEL, "revision": MODEL, "offline": MODEL, "hf_token": MODEL,
    "served_model_name": MODEL, "strict_model_name": MODEL, "tokenizer": MODEL,
    "generation_config": MODEL, "seed": MODEL, "backend": MODEL, "dtype": MODEL, "device": MODEL,
    "max_model_len": MODEL, "trust_remote_code": MODEL, "allow_unverified_architecture": MODEL, "task": MODEL,
    "cache_dir": MODEL, "models": MODEL, "models_dir": MODEL, "serve_cached_models": MODEL,
    "max_loaded_models": MODEL, "idle_unload_seconds": MODEL, "allow_pull": MODEL,
    # engine
    "block_size": ENGINE, "num_kv_blocks": ENGINE, "kv_cache_memory_fraction": ENGINE, "kv_cache_dtype": ENGINE,
    "max_num_seqs": ENGINE,
    "max_num_batched_tokens": ENGINE, "enable_prefix_caching": ENGINE, "enable_chunked_prefill": ENGINE,
    "speculative_config": ENGINE, "spec_draft_model": ENGINE, "spec_draft_n_max": ENGINE, "enforce_eager": ENGINE,
    # limits and lifecycle
    "max_concurrent_requests": LIMITS, "max_waiting_requests": LIMITS, "max_waiting_tokens": LIMITS,
    "max_prompt_chars": LIMITS, "max_logprobs": LIMITS, "max_stop_strings": LIMITS, "max_stop_chars": LIMITS,
    "strict_max_tokens": LIMITS,
    "request_timeout": LIMITS, "sse_ping_interval": LIMITS, "heap_trim_interval": LIMITS,
    "shutdown_timeout": LIMITS,
    # server
    "host": SERVER, "port": SERVER, "protocols": SERVER, "protocol_prefix": SERVER, "root_path": SERVER,
    "enable_request_id_headers": SERVER, "timeout_keep_alive": SERVER, "max_request_body_bytes": SERVER,
    "max_header_bytes": SERVER, "max_header_count": SERVER, "timeout_request_headers": SERVER,
    "timeout_request_body": SERVER,
    # security
    "api_key": SECURITY, "public_metrics": SECURITY, "ssl_keyfile": SECURITY, "ssl_certfile": SECURITY,
    "ssl_ca_certs": SECURITY, "ssl_cert_reqs": SECURITY, "cors_allow_origins": SECURITY,
    "cors_allow_credentials": SECURITY, "cors_allow_methods": SECURITY, "cors_allow_headers": SECURITY,
    "allowed_origins": SECURITY,
    # images in requests
    "allowed_media_domains": MEDIA, "allowed_media_networks": MEDIA, "media_allow_http": MEDIA,
    "allowed_local_media_path": MEDIA, "max_image_bytes": MEDIA, "max_image_pixels": MEDIA,
    "max_images_per_request": MEDIA, "media_fetch_timeout": MEDIA, "media_max_redirects": MEDIA,
    # chat templates and what outputs carry
    "chat_template": TEMPLATES, "chat_template_render_timeout": TEMPLATES, "trust_request_chat_template": TEMPLATES,
    "return_tokens_as_token_ids": TEMPLATES, "enable_force_include_usage": TEMPLATES,
    # tools and parsers
    "tool_call_parser": TOOLS, "enable_auto_tool_choice": TOOLS, "tool_parser_plugin": TOOLS,
    "reasoning_parser": TOOLS, "reasoning_effort_budgets": TOOLS, "reasoning_budget_message": TOOLS,
    # guided decoding
    "guided_decoding_backend": GUIDED, "guided_compile_timeout": GUIDED, "guided_max_bytes": GUIDED,
    "guided_max_depth": GUIDED, "guided_max_items": GUIDED,
    # plugins, logging, scale-out
    "plugins": PLUGINS,
    "log_level": LOGGING, "uvicorn_log_level": LOGGING, "disable_uvicorn_access_log": LOGGING,
    "ray_replicas": SCALE, "tensor_parallel_size": SCALE,
}


def panel_of(field: str) -> str:
    """The help panel of a ``ServerConfig`` field (KeyError for a field the table misses)."""
    return PANELS[field]


def default_text(model: type[BaseModel], field: str) -> str:
    """``[default: ...]`` for the help of ``model.field``, or "" when it has no default to show."""
    value = model.model_fields[field].get_default(call_default_factory=True)
    if value is PydanticUndefined or value is None or value == [] or value == {} or value == "":
        return ""
    if isinstance(value, bool):
        shown = "on" if value else "off"
    elif isinstance(value, (list, dict)):
        shown = json.dumps(value)
    else:
        shown = str(value)
    return f"[default: {shown}]"


class PanelCommand(typer.core.TyperCommand):
    """A command whose ``--help`` is plain text in panels (``rich_help_panel`` of each option)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # click's own layout (usage, text, options, epilog), past typer's rich rendering
        super(typer.core.TyperCommand, self).format_help(ctx, formatter)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or GENERAL, []).append(record)
        rows = arguments + [row for group in panels.values() for row in group]
        column = min(max((len(first) for first, _ in rows), default=0), COLUMN_MAX) + 2
        if arguments:
            with formatter.section("Arguments"):
                write_rows(formatter, arguments, column)
        for name in sorted(panels, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
            with formatter.section(name):
                write_rows(formatter, panels[name], column)


COLUMN_MAX = 30  # a longer flag gets a line of its own, its help below it


def write_rows(formatter: Any, rows: list[tuple[str, str]], column: int) -> None:
    """click's definition list, except that text never breaks inside a word such as a flag name
    (``--kv-cache-memory-fraction`` stays whole) and every panel shares one column."""
    indent = formatter.current_indent
    width = max(formatter.width - column - indent, 20)
    for first, second in rows:
        formatter.write(f"{'':>{indent}}{first}")
        # "[default: X]" stays on one line (a NUL stands for its space while wrapping)
        text = second.replace("[default: ", "[default:\0")
        lines = [line.replace("\0", " ") for line in
                 textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)] or [""]
        if len(first) <= column - 2:
            formatter.write(" " * (column - len(first)))
        else:
            formatter.write("\n" + " " * (column + indent))
        formatter.write(lines[0] + "\n")
        for line in lines[1:]:
            formatter.write(f"{'':>{column + indent}}{line}\n")


def help_context() -> dict[str, Any]:
    """Context settings every command shares: ``-h`` is ``--help``."""
    return {"help_option_names": ["-h", "--help"]}
