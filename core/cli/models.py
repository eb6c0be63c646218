"""``llmserve pull``, ``ls`` and ``rm``: the models in the local Hugging Face cache, the same cache
``serve`` reads a repo id from (and that vLLM, transformers and llama.cpp share).

They are the kernel's commands, not a plugin's: they talk to no running server, they manage the
files ``serve`` resolves ``MODEL`` to, through the same resolver (``llmserve.models``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

import typer

from llmserve.cli.options import fail
from llmserve.errors import ConfigError

REVISION = typer.Option(None, "--revision", help="Branch, tag or commit (default: main).")
TOKEN = typer.Option(None, "--hf-token", help="Token for gated or private repos (default: HF_TOKEN).")
JSON = typer.Option(False, "--json", help="Print JSON.")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ago(stamp: float) -> str:
    if not stamp:
        return "-"
    seconds = max(0.0, time.time() - stamp)
    for unit, scale in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit} ago"
    return "just now"


def pull(model: str = typer.Argument(..., metavar="ID[:QUANT]", help="Hugging Face repo id, e.g. org/name or "
                                     "org/name-GGUF:Q4_K_M."),
         revision: Optional[str] = REVISION, hf_token: Optional[str] = TOKEN,
         mmproj: bool = typer.Option(False, "--mmproj", help="Fetch a GGUF repo's vision projector too."),
         as_json: bool = JSON) -> None:
    """Download a model from the Hugging Face Hub into the local cache (what `serve ID` loads)."""
    from llmserve.models.cache import env_offline
    from llmserve.models.ref import require_ref
    from llmserve.models.resolve import plan_model
    from llmserve.server.serve import setup_logging

    setup_logging("info")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        require_ref(model)
        if env_offline():
            raise ConfigError(f"`llmserve pull` needs the network, and HF_HUB_OFFLINE is set: unset it to fetch "
                              f"{model}")
        resolved = plan_model(model, revision=revision, token=hf_token, mmproj=mmproj,
                              need_cache=False).resolve(refresh=True)
    except ConfigError as exc:
        fail(str(exc), 1)
        return
    if as_json:
        typer.echo(json.dumps(resolved.as_json(), indent=2))
    else:
        typer.echo(f"{resolved.name}: {resolved.path}")


def ls(as_json: bool = JSON) -> None:
    """List the models in the local Hugging Face cache: name, architecture, size, last use, files."""
    from llmserve.models.cache import hub_cache_dir, list_cached

    models = list_cached()
    if as_json:
        typer.echo(json.dumps([m.as_json() for m in models], indent=2))
        return
    if not models:
        typer.echo(f"no models in the Hugging Face cache ({hub_cache_dir()}); fetch one with `llmserve pull ID`")
        return
    rows = [("NAME", "ARCHITECTURE", "QUANT", "SIZE", "LAST USED", "FILES")]
    for m in models:
        files = ", ".join(os.path.basename(f) for f in m.files[:3]) + (f", +{len(m.files) - 3}" if len(m.files) > 3
                                                                        else "")
        rows.append((m.name, m.architecture or "?", m.quant or "-", _size(m.size), _ago(m.last_used), files))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def rm(model: str = typer.Argument(..., metavar="ID[:QUANT]", help="Repo id (every file of it), or ID:QUANT "
                                   "(that GGUF model only)."),
       as_json: bool = JSON) -> None:
    """Delete a model from the local Hugging Face cache."""
    from llmserve.models.cache import remove_cached
    from llmserve.models.ref import require_ref

    try:
        ref = require_ref(model)
        removed = remove_cached(ref)
    except ConfigError as exc:
        fail(str(exc), 1)
        return
    except OSError as exc:
        fail(f"cannot delete {model} from the Hugging Face cache: {exc.strerror or exc}", 1)
        return
    if as_json:
        typer.echo(json.dumps({"name": ref.name, "removed": removed}, indent=2))
    else:
        typer.echo(f"removed {ref.name} ({len(removed)} files)")


def add_model_commands(cli: typer.Typer) -> None:
    """Add ``pull``, ``ls`` and ``rm`` to the ``llmserve`` app."""
    cli.command("pull")(pull)
    cli.command("ls")(ls)
    cli.command("rm")(rm)
