"""The ``llmserve`` command line (typer): the kernel's own commands (serve, plugins, parse, config
show, version, warmup) and ``main()``, which adds the commands of plugins (``register_commands``:
the built-in ``chat``, ``bench`` and ``ray-serve`` come from the ``commands`` plugin) and then
the flags of each installed backend's options.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from llmserve import __version__
from llmserve.cli.help import PanelCommand, help_context
from llmserve.cli.models import add_model_commands
from llmserve.cli.options import (CONFIG_OPTION, PLUGIN_OPTION, add_backend_options, backend_option_models, fail,
                                  resolve_config, with_config_options)
from llmserve.config import FIELDS, flat_values, load_options
from llmserve.errors import ConfigError
from llmserve.hooks.manager import PluginManager

if TYPE_CHECKING:
    from llmserve.hooks.registry import Registry

# Plain help (no rich boxes): it wraps at any width and never cuts a flag name; -h is --help.
cli = typer.Typer(no_args_is_help=True, add_completion=False, help="llmserve: serve LLMs in every major dialect.",
                  rich_markup_mode=None, context_settings=help_context())
config_cli = typer.Typer(no_args_is_help=True, help="Inspect the effective configuration.", rich_markup_mode=None)
cli.add_typer(config_cli, name="config")

_plugins: PluginManager | None = None


def plugin_manager() -> PluginManager:
    """The process-wide plugin manager with built-ins and auto-discovered plugins loaded."""
    global _plugins
    if _plugins is None:
        _plugins = PluginManager().load()
    return _plugins


def plugin_registry() -> "Registry":
    """The contributions of ``plugin_manager()``'s plugins."""
    from llmserve.hooks.registry import Registry

    return Registry.collect(plugin_manager())


def with_cli_plugins(specs: list[str] | None) -> PluginManager:
    """The plugin manager with the command's ``--plugin`` specs loaded (``ConfigError`` on a bad one)."""
    pm = plugin_manager()
    for spec in specs or []:
        pm.load_spec(spec, "cli")
    return pm


@cli.command(cls=PanelCommand)
@with_config_options
def serve(model_arg: Optional[str] = typer.Argument(
              None, metavar="MODEL", show_default=False,
              help="Model directory, .gguf file or Hugging Face id org/name[:QUANT] (default: embedded "
                   "SmolLM2-135M-Instruct); or --model."),
          config: Optional[Path] = CONFIG_OPTION, *, flags: dict[str, Any]) -> None:
    """Load a model and serve it in every enabled dialect."""
    if model_arg is not None:
        if flags.get("model") not in (None, model_arg):  # vLLM's --model spelling, given as well
            fail(f"the model is given twice, as the MODEL argument ({model_arg!r}) and as --model "
                 f"({flags['model']!r}); give one")
        flags["model"] = model_arg
    cfg, _ = resolve_config(flags, config)
    from llmserve.server.serve import run_server

    try:
        code = run_server(cfg, plugin_manager())
    except ConfigError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@cli.command("plugins")
def plugins_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON."),
                plugin: Optional[list[str]] = PLUGIN_OPTION) -> None:
    """List every plugin, its distribution and version, and what it contributes."""
    from llmserve.hooks.registry import Registry

    try:
        pm = with_cli_plugins(plugin)
        Registry.collect(pm)
    except ConfigError as exc:
        fail(str(exc))
    rows = [vars(info) for info in pm.infos.values()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else "(no distribution)"
        typer.echo(f"{row['name']}  [{row['source']}]  {dist}")
        if row["error"]:
            typer.echo(f"    failed to load: {row['error']}")
        for kind, names in sorted(row["contributes"].items()):
            typer.echo(f"    {kind}: {', '.join(names)}")


@cli.command("parse")
def parse_cmd(tool_parser: Optional[str] = typer.Option(None, "--tool-parser", help="Tool-call parser name."),
              reasoning_parser: Optional[str] = typer.Option(None, "--reasoning-parser", help="Reasoning parser name."),
              tools: Optional[Path] = typer.Option(None, "--tools", help="JSON file with an OpenAI tools list."),
              chunk: int = typer.Option(0, "--chunk", min=0,
                                        help="Feed the text in N-character pieces (streaming path)."),
              template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs",
                                                            help='JSON object, e.g. \'{"enable_thinking": false}\'.'),
              detect: Optional[str] = typer.Option(
                  None, "--detect", metavar="MODEL",
                  help="Print the parsers that `auto` picks from MODEL's chat template (a model directory, .gguf or "
                       "template file) and the evidence, instead of parsing stdin."),
              plugin: Optional[list[str]] = PLUGIN_OPTION) -> None:
    """Parse one model output from stdin; print {"content", "reasoning_content", "tool_calls"} as JSON.

    With --detect MODEL: print the tool-call and reasoning parsers detected from the model's chat template.
    """
    from llmserve.parsing.chain import StreamContractError
    from llmserve.parsing.cli import load_tools, parse_output
    from llmserve.hooks.registry import Registry

    try:
        pm = with_cli_plugins(plugin)
        kwargs = json.loads(template_kwargs) if template_kwargs else {}
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ConfigError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(f"--chat-template-kwargs: {exc}")
    if detect is not None:
        from llmserve.parsing.cli import detect_output

        try:
            typer.echo("\n".join(detect_output(detect, Registry.collect(pm))))
        except ConfigError as exc:
            fail(str(exc))
        return
    text = typer.get_binary_stream("stdin").read().decode("utf-8", errors="replace")
    try:
        result = parse_output(text, Registry.collect(pm), tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                              tools=load_tools(tools), chat_template_kwargs=kwargs, chunk=chunk)
    except ConfigError as exc:
        fail(str(exc))
    except StreamContractError as exc:
        fail(f"the parser broke the streaming contract: {exc}", 1)
    except Exception as exc:  # noqa: BLE001 - a plugin parser's bug: one line, not a traceback
        fail(f"the parser failed: {type(exc).__name__}: {exc}", 1)
    typer.echo(json.dumps(result, ensure_ascii=False))


@config_cli.command("show", cls=PanelCommand)
@with_config_options
def config_show(config: Optional[Path] = CONFIG_OPTION,
                as_json: bool = typer.Option(False, "--json", help="Print JSON."), *, flags: dict[str, Any]) -> None:
    """Print the effective configuration and where each value came from.

    The selected backend's options follow the settings, as ``<backend>.<field>``.
    """
    cfg, sources = resolve_config(flags, config)
    values = flat_values(cfg)
    values["api_key"] = ["***"] * len(values["api_key"])  # secrets are never printed
    values["hf_token"] = "***" if values["hf_token"] else None
    rows = {k: (values[k], sources[k]) for k in FIELDS}
    try:
        backend = cfg.llm.backend
        model = backend_option_models(plugin_registry()).get(backend)
        if model is not None:
            options, option_sources = load_options(backend, model, cfg)
            for field, value in options.model_dump(mode="json").items():
                rows[f"{backend}.{field}"] = (value, option_sources[field])
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps({k: {"value": v, "source": src} for k, (v, src) in rows.items()}, indent=2))
        return
    width = max(len(k) for k in rows) + 2
    for key, (value, source) in rows.items():
        typer.echo(f"{key.replace('_', '-'):<{width}}{json.dumps(value):<40} {source}")


add_model_commands(cli)  # pull, ls, rm: the models in the local Hugging Face cache


@cli.command("version")
def version_cmd() -> None:
    """Print the llmserve version."""
    typer.echo(__version__)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"llmserve {__version__}")
        raise typer.Exit(0)


@cli.callback()
def _global_options(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                                 help="Print the version and exit.")) -> None:
    """llmserve: serve LLMs in every major dialect."""


@cli.command("warmup", cls=PanelCommand)
@with_config_options
def warmup_cmd(model_arg: Optional[str] = typer.Argument(
                   None, metavar="MODEL", show_default=False,
                   help="Model directory, .gguf file or Hugging Face id to prepare (default: the embedded model)."),
               config: Optional[Path] = CONFIG_OPTION, *, flags: dict[str, Any]) -> None:
    """Do the slow once-per-machine work now: build the native kernels, convert and cache the model.

    Takes the options of `serve`; a `serve` with the same model then starts from the caches.
    """
    if model_arg is not None:
        flags["model"] = model_arg
    cfg, _ = resolve_config(flags, config)
    from llmserve.warmup import warm_up

    try:
        warm_up(cfg, plugin_manager())
    except ConfigError as exc:
        fail(str(exc))


_commands_added = False


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    global _commands_added
    try:
        pm = plugin_manager()
        if not _commands_added:  # once per process: a second main() would add each command twice
            pm.hook.register_commands(cli=cli)
            _commands_added = True
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    try:
        add_backend_options(plugin_registry())
    except (ConfigError, ImportError, AttributeError, ValueError):
        pass  # a broken plugin is reported by the command that uses it, in one line
    cli(args=argv, prog_name="llmserve")
