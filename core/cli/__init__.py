"""The ``llmserve`` command line: the typer app, ``main()`` (the console script), and what a
command plugin may build on.

A plugin adds commands with the ``register_commands`` hook and imports from here, never from
the modules of this package, only these names:

- ``with_config_options``: gives a command one option per server setting (and per backend
  option); the command receives them as a dict in ``flags``;
- ``resolve_config(flags, config_file)``: those flags, the environment and the YAML file ->
  ``(ServerConfig, sources)``;
- ``CONFIG_OPTION`` / ``PLUGIN_OPTION``: the shared ``--config`` and ``--plugin`` options;
- ``PanelCommand``: the plain, panelled ``--help`` of the commands that take the settings;
- ``fail(message)``: ``error: MESSAGE`` on stderr, exit status 2;
- ``plugin_manager()``: the process's plugins.

The built-in ``commands`` plugin (``llmserve.plugins.commands``: ``chat``, ``bench``,
``ray-serve``) is the worked example. Inside: ``app.py`` (the kernel's commands and ``main``),
``options.py`` (the settings as options), ``help.py`` (the help panels).
"""

from llmserve.cli.app import cli, main, plugin_manager, plugin_registry
from llmserve.cli.help import PanelCommand, help_context
from llmserve.cli.options import CONFIG_OPTION, PLUGIN_OPTION, fail, resolve_config, with_config_options

__all__ = ["CONFIG_OPTION", "PLUGIN_OPTION", "PanelCommand", "cli", "fail", "help_context", "main", "plugin_manager",
           "plugin_registry", "resolve_config", "with_config_options"]
