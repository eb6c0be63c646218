"""The command line's own help: every flag in a panel, whole at 80 columns, defaults shown;
``--version``, ``-V`` and ``-h`` on every command."""

from __future__ import annotations

import re

import pytest

from conftest import run_cli

from llmserve.cli.help import BACKEND_PANEL, ORDER, PANELS, panel_of
from llmserve.config import FIELDS, SchedulerConfig, _kind, flag_name

NARROW = {"COLUMNS": "80", "LINES": "40"}


@pytest.fixture(scope="module")
def serve_help() -> str:
    out = run_cli("serve", "--help", env=NARROW)
    assert out.returncode == 0, out.stderr
    return out.stdout


def sections(text: str) -> dict[str, str]:
    """``panel title -> its lines`` of a help text."""
    found: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if re.fullmatch(r"[A-Z][\w ,-]*:", line):
            current = line[:-1]
            found[current] = ""
        elif current is not None:
            found[current] += line + "\n"
    return found


def test_every_setting_has_a_panel():
    assert [f for f in FIELDS if f not in PANELS] == []
    assert {panel_of(f) for f in FIELDS} <= set(ORDER)


def test_every_flag_name_is_whole_at_80_columns(serve_help):
    names = re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", serve_help)
    for field in FIELDS:
        flag = flag_name(field)
        assert flag in names, f"{flag} is not whole in serve --help"
        if _kind(field) == "bool":
            assert f"--no-{flag[2:]}" in names
    assert "--torch-compact-weights" in names and "--no-torch-native-step" in names  # backend options
    assert max(len(line) for line in serve_help.splitlines()) <= 80
    assert "…" not in serve_help


def test_flags_sit_in_their_panels_with_defaults(serve_help):
    panels = sections(serve_help)
    for title in ("Model", "Engine", "Server", "Security", "Tools and parsers", "Plugins", "Logging", BACKEND_PANEL):
        assert title in panels, sorted(panels)
    for field in FIELDS:
        assert re.search(rf"(?<![\w-]){re.escape(flag_name(field))}(?![\w-])", panels[panel_of(field)]), field
    assert "--torch-threads" in panels[BACKEND_PANEL]
    server = panels["Server"]
    assert re.search(r"--port <int>\s+Port to bind\.\s+\[default: 8000\]", server)
    assert "[default: 127.0.0.1]" in server
    assert "[default: on]" in panels["Engine"]  # --enable-prefix-caching
    assert SchedulerConfig.model_fields["max_num_seqs"].default == 64 and "[default: 64]" in panels["Engine"]


def test_config_show_and_warmup_share_the_panels():
    for command in (("config", "show"), ("warmup",)):
        out = run_cli(*command, "--help", env=NARROW)
        assert out.returncode == 0, out.stderr
        assert {"Model", "Server", BACKEND_PANEL} <= set(sections(out.stdout)), out.stdout


def test_version():
    from llmserve import __version__

    for flag in ("--version", "-V"):
        out = run_cli(flag)
        assert out.returncode == 0 and out.stdout.strip() == f"llmserve {__version__}", out.stdout + out.stderr


@pytest.mark.parametrize("command", [(), ("serve",), ("config",), ("config", "show"), ("plugins",), ("parse",),
                                     ("version",), ("warmup",), ("chat",), ("bench",)])
def test_h_is_help_on_every_command(command):
    short, long = run_cli(*command, "-h", env=NARROW), run_cli(*command, "--help", env=NARROW)
    assert short.returncode == 0 and long.returncode == 0, short.stderr + long.stderr
    assert short.stdout == long.stdout and "Usage: " in short.stdout


def test_the_documented_serve_help_is_the_real_one(serve_help):
    from conftest import ROOT

    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"<!-- serve-help -->\n```text\n\$ llmserve serve --help\n(.*?)```\n<!-- /serve-help -->", text,
                      re.S)
    assert block, "docs/cli.md lost its serve --help sample"
    assert block.group(1) == serve_help, "regenerate it: python docs/tools/refresh_cli_docs.py"
