"""The options every server-settings command shares: one typer option per ``ServerConfig`` field
and per backend option, the config loader behind them, and the one-line failure.

Options are generated from ``ServerConfig`` so the flags, YAML keys and environment variables
can never drift apart; ``add_backend_options`` adds one flag per field of each installed
backend's options model (``--torch-fused-forward``), read through the registry, so the core
never names a backend.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, get_args, get_type_hints

import typer
from pydantic import BaseModel

from llmserve.cli.help import BACKEND_PANEL, default_text, panel_of
from llmserve.config import (FIELDS, FLAG_ALIASES, ServerConfig, _kind, field_owner, flag_name, load_config,
                             option_flag)
from llmserve.errors import ConfigError
from llmserve.hooks.records import resolve

if TYPE_CHECKING:
    from llmserve.hooks.registry import Registry

# Commands that take the config options, and the backend option flags they were given:
# parameter name -> (backend name, option field).
_CONFIG_COMMANDS: list[Callable[..., Any]] = []
_BACKEND_PARAMS: dict[str, tuple[str, str]] = {}


def fail(message: str, code: int = 2) -> None:
    """Print ``error: MESSAGE`` on stderr and exit with ``code`` (2: a usage or configuration error)."""
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
    elif kind in ("list", "dict") or (model is ServerConfig and field == "model"):  # --model repeats
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
        if isinstance(flags.get("model"), list):  # --model given several times: the first is MODEL
            first, *more = flags["model"]
            flags["model"] = first
            if more:
                flags["models"] = [*more, *(flags.get("models") or [])]
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
    """The effective ``ServerConfig`` (CLI > env > YAML > defaults) and where each value came from;
    a bad value ends the command through ``fail``."""
    try:
        return load_config(flags, str(config_file) if config_file else None)
    except ConfigError as exc:
        fail(str(exc))
        raise  # unreachable


CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML file whose keys are the long flag names.")
PLUGIN_OPTION = typer.Option(None, "--plugin", help="Extra plugin spec; repeatable.")
