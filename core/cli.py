"""The ``llmserve`` command line (typer): serve, plugins, parse, config show, and plugin commands.

Options of ``serve`` and ``config show`` are generated from ``ServerConfig`` so the flags,
YAML keys and environment variables can never drift apart; ``main()`` adds one flag per field
of each installed backend's options model (``--torch-fused-forward``), read through the
registry, so the core never names a backend.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, get_args, get_type_hints

import typer
from pydantic import BaseModel

from llmserve import __version__
from llmserve.bench.command import bench_cli
from llmserve.chat_cli import chat_command
from llmserve.cli_help import BACKEND_PANEL, PanelCommand, default_text, help_context, panel_of
from llmserve.config import (FIELDS, FLAG_ALIASES, ServerConfig, _kind, field_owner, flag_name, flat_values,
                             load_config, load_options, option_flag)
from llmserve.errors import ConfigError
from llmserve.ray_serve import ray_serve_command
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.records import resolve

if TYPE_CHECKING:
    from llmserve.hooks.registry import Registry

# Plain help (no rich boxes): it wraps at any width and never cuts a flag name; -h is --help.
cli = typer.Typer(no_args_is_help=True, add_completion=False, help="llmserve: serve LLMs in every major dialect.",
                  rich_markup_mode=None, context_settings=help_context())
config_cli = typer.Typer(no_args_is_help=True, help="Inspect the effective configuration.", rich_markup_mode=None)
cli.add_typer(config_cli, name="config")

_plugins: PluginManager | None = None
# Commands that take the config options, and the backend option flags they were given:
# parameter name -> (backend name, option field).
_CONFIG_COMMANDS: list[Callable[..., Any]] = []
_BACKEND_PARAMS: dict[str, tuple[str, str]] = {}


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


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _option(name: str, model: type[BaseModel], field: str, flag: str, aliases: Sequence[str] = ()) -> inspect.Parameter:
    """The typer parameter ``name`` for ``model.field`` as the long option ``flag`` (and ``aliases``)."""
    owner = field_owner(field, model)  # a setting's section declares it
    info = owner.model_fields[field]
    kind = _kind(field, model)
    help_text = info.description or ""
    literal = [a for a in get_args(info.annotation) if a is not type(None)]
    choices = get_args(info.annotation) if getattr(info.annotation, "__origin__", None) is Literal else ()
    if choices:
        help_text += f" One of: {', '.join(choices)}."
    help_text = f"{help_text} {default_text(owner, field)}".strip()
    panel = panel_of(field) if model is ServerConfig else BACKEND_PANEL
    if kind == "bool":
        default = typer.Option(None, f"{flag}/--no-{flag[2:]}", *aliases, help=help_text, show_default=False,
                               rich_help_panel=panel)
        annotation: Any = Optional[bool]
    elif kind in ("list", "dict"):
        default = typer.Option(None, flag, *aliases, help=help_text, show_default=False,
                               rich_help_panel=panel)
        annotation = Optional[list[str]]
    else:
        base = literal[0] if literal else info.annotation
        annotation = Optional[base] if base in (int, float) else Optional[str]
        default = typer.Option(None, flag, *aliases, help=help_text, show_default=False,
                               rich_help_panel=panel)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def with_config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` one option per config field; it receives them as a dict in ``flags``.

    Backend option flags (added by ``add_backend_options``) arrive there as
    ``flags[backend][field]``, the shape ``load_config`` takes them in.
    """
    hints = get_type_hints(fn)  # annotations are strings here (postponed evaluation)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(fn).parameters.values() if p.name != "flags"]
    own_names = {p.name for p in own}
    extra = [_option(f, ServerConfig, f, flag_name(f), FLAG_ALIASES.get(f, ())) for f in FIELDS if f not in own_names]

    def wrapper(**kwargs: Any) -> Any:
        flags: dict[str, Any] = {f: kwargs.pop(f) for f in FIELDS if f in kwargs and f not in own_names}
        for param, (section, field) in _BACKEND_PARAMS.items():
            if param in kwargs:
                flags.setdefault(section, {})[field] = kwargs.pop(param)
        return fn(flags=flags, **kwargs)

    wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    _CONFIG_COMMANDS.append(wrapper)
    return wrapper


def backend_option_models(registry: "Registry") -> dict[str, type[BaseModel]]:
    """``backend name -> options model`` of every backend whose record declares one."""
    models = {}
    for name in registry.names("backend"):
        options = registry.get("backend", name).record.options
        if options:
            models[name] = resolve(options)
    return models


def add_backend_options(registry: "Registry") -> None:
    """Add ``--<backend>-<field>`` to ``serve`` and ``config show`` for each backend option.

    A flag that would shadow a server setting is left out (YAML and environment still set it).
    """
    taken = {flag_name(f) for f in FIELDS} | {a for names in FLAG_ALIASES.values() for a in names}
    params = []
    for section, model in backend_option_models(registry).items():
        for field in model.model_fields:
            flag = option_flag(section, field)
            param = f"{section}__{field}".replace("-", "_")
            if flag in taken or param in _BACKEND_PARAMS:
                continue
            _BACKEND_PARAMS[param] = (section, field)
            params.append(_option(param, model, field, flag))
    for command in _CONFIG_COMMANDS:
        sig = inspect.signature(command)
        command.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *params])  # type: ignore[attr-defined]


def resolve_config(flags: dict[str, Any], config_file: Optional[Path]) -> tuple[ServerConfig, dict[str, str]]:
    try:
        return load_config(flags, str(config_file) if config_file else None)
    except ConfigError as exc:
        fail(str(exc))
        raise  # unreachable


CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML file whose keys are the long flag names.")
PLUGIN_OPTION = typer.Option(None, "--plugin", help="Extra plugin spec; repeatable.")


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
              help="Model directory or .gguf file (default: embedded SmolLM2-135M-Instruct); or --model."),
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
              plugin: Optional[list[str]] = PLUGIN_OPTION) -> None:
    """Parse one model output from stdin; print {"content", "reasoning_content", "tool_calls"} as JSON."""
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
                   help="Model directory or .gguf file to prepare (default: the embedded model)."),
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


# Client commands: they import their HTTP client and load generator when they run.
cli.command("chat")(chat_command)
cli.command("ray-serve", cls=PanelCommand)(with_config_options(ray_serve_command))  # Ray is imported only when it runs
cli.add_typer(bench_cli, name="bench")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        pm = plugin_manager()
        pm.hook.register_commands(cli=cli)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    try:
        add_backend_options(plugin_registry())
    except (ConfigError, ImportError, AttributeError, ValueError):
        pass  # a broken plugin is reported by the command that uses it, in one line
    cli(args=argv, prog_name="llmserve")
