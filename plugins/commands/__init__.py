"""The built-in client commands: ``llmserve chat``, ``llmserve bench serve`` and ``llmserve
ray-serve``, added to the command line with the ``register_commands`` hook, exactly as an
installed plugin adds its own.

``chat.py`` (the terminal chat), ``remote.py`` (talking to a running server: URLs, API keys,
one-line errors), ``bench/`` (the load generator and its report) and ``ray_serve.py``
(replicas behind Ray Serve). The command modules are imported only when the command line is
built, never by ``llmserve plugins`` or a server; httpx and Ray only when a command runs. They
build on the command line's stable surface, ``llmserve.cli``.
"""

from __future__ import annotations

from typing import Any

from llmserve import hookimpl


@hookimpl
def register_commands(cli: Any) -> None:
    from llmserve import PanelCommand, with_config_options

    from .bench.command import bench_cli
    from .chat import chat_command
    from .ray_serve import ray_serve_command

    cli.command("chat")(chat_command)
    # ray-serve takes every serve setting, as options generated from ServerConfig
    cli.command("ray-serve", cls=PanelCommand)(with_config_options(ray_serve_command))
    cli.add_typer(bench_cli, name="bench")
