"""``llmserve parse``: same result as the parser itself, whole or in pieces; clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmserve.cli import cli

from .cases import ALL_CASES, HERMES, case_id
from .helpers import registry, structure, whole

ROOT = Path(__file__).resolve().parents[2]


def cli_args(case, tmp_path, chunk=None):
    args = ["parse"]
    if case.tool_parser:
        args += ["--tool-parser", case.tool_parser]
    if case.reasoning_parser:
        args += ["--reasoning-parser", case.reasoning_parser]
    if case.tools:
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps(case.tools))
        args += ["--tools", str(tools)]
    if case.template_kwargs:
        args += ["--chat-template-kwargs", json.dumps(case.template_kwargs)]
    if chunk:
        args += ["--chunk", str(chunk)]
    return args


def cli_cases() -> list:
    """One case per way of calling the command (tool parser, reasoning parser, a tools file,
    template kwargs): of each, the one with the most calls. The parsers themselves run every case
    whole and in pieces in test_cases.py; here what is checked is the command's plumbing (flags,
    reading stdin in chunks, printing), which each of these exercises (about 50 of the ~500 cases)."""
    chosen: dict[tuple, object] = {}
    for case in ALL_CASES:
        key = (case.tool_parser, case.reasoning_parser, bool(case.tools), bool(case.template_kwargs))
        if key not in chosen or len(case.calls) > len(chosen[key].calls):
            chosen[key] = case
    return list(chosen.values())


@pytest.mark.parametrize("chunk", [None, 1, 7])
@pytest.mark.parametrize("case", cli_cases(), ids=case_id)
def test_cli_equals_the_parser(case, chunk, tmp_path):
    result = CliRunner().invoke(cli, cli_args(case, tmp_path, chunk), input=case.text.encode("utf-8"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1  # one JSON object
    printed = json.loads(lines[0])
    assert set(printed) == {"content", "reasoning_content", "tool_calls"}
    assert structure(printed) == whole(case)


def run(*args, stdin="", env=None):
    return subprocess.run([sys.executable, "-m", "llmserve", *args], input=stdin.encode(), capture_output=True,
                          cwd=ROOT, timeout=120, env={**os.environ, **(env or {})})


def test_real_subprocess_runs_and_keeps_bytes_exact():
    case = HERMES[5]  # non-ASCII, text before the call
    out = run("parse", "--tool-parser", "hermes", "--chunk", "7", stdin=case.text)
    assert out.returncode == 0, out.stderr
    assert structure(json.loads(out.stdout.decode("utf-8"))) == whole(case)
    crlf = run("parse", "--reasoning-parser", "deepseek_r1", stdin="a\r\nb</think>\r\nc")
    assert json.loads(crlf.stdout) == {"content": "\r\nc", "reasoning_content": "a\r\nb", "tool_calls": []}


def test_parse_never_imports_torch_or_parser_modules_it_does_not_use():
    code = textwrap.dedent("""
        import sys
        from llmserve.cli import main
        for argv in (['plugins'], ['parse', '--tool-parser', 'hermes']):
            try:
                main(argv)
            except SystemExit:
                pass
        loaded = sorted(m for m in sys.modules if m.startswith('llmserve.plugins.tool_parsers.'))
        print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules], loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], input=b"<tool_call>{", capture_output=True, timeout=120,
                         cwd=ROOT)
    # hermes and the forced-call layout it declares (forced_json), no other family's module.
    assert "HEAVY [] ['llmserve.plugins.tool_parsers.forced_json', 'llmserve.plugins.tool_parsers.hermes']" \
           in out.stdout.decode(), out.stdout.decode() + out.stderr.decode()


@pytest.mark.parametrize("args,message", [
    # The listing is every registered name, sorted (the registry's own order).
    (["--tool-parser", "nope"], "error: unknown tool parser 'nope'; available: "
                                + ", ".join(registry().names("tool_parser"))),
    (["--reasoning-parser", "nope"], "error: unknown reasoning parser 'nope'; available: "
                                     + ", ".join(registry().names("reasoning_parser"))),
    (["--tool-parser", "hermes", "--chat-template-kwargs", "[1]"], "error: --chat-template-kwargs: not a JSON object"),
    (["--plugin", "no_such_module_xyz"], "error: cannot load plugin 'no_such_module_xyz': ModuleNotFoundError: "
                                         "No module named 'no_such_module_xyz'"),
])
def test_errors_are_one_clear_line_and_exit_2(args, message):
    result = CliRunner().invoke(cli, ["parse", *args], input="x")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [message]


def test_bad_tools_file(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text('{"not": "a list"}')
    result = CliRunner().invoke(cli, ["parse", "--tool-parser", "internlm", "--tools", str(bad)], input="x")
    assert result.exit_code == 2 and "expected a JSON list of tool objects" in result.stderr
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"tools": [{"type": "function", "function": {"name": "search"}}]}))
    text = '<|action_start|><|plugin|>{"name": "search", "parameters": {}}<|action_end|>'
    ok = CliRunner().invoke(cli, ["parse", "--tool-parser", "internlm", "--tools", str(wrapped)], input=text)
    assert json.loads(ok.stdout)["tool_calls"][0]["function"]["name"] == "search"


def test_a_parser_that_breaks_the_contract_is_reported(tmp_path):
    plugin = tmp_path / "sloppy.py"
    plugin.write_text(textwrap.dedent("""
        from llmserve import hookimpl
        from llmserve.hooks.records import ToolParserSpec
        from llmserve.parsing.contract import ParseDelta, ToolCallDelta, ToolParser

        class Sloppy(ToolParser):  # repeats id and name on every piece
            def feed(self, text, token_ids=()):
                return ParseDelta(tool_calls=[ToolCallDelta(0, id="x", name="f", arguments=text)])
            def finish(self):
                return ParseDelta()

        class Crashing(Sloppy):
            def finish(self):
                raise KeyError("oops")

        @hookimpl
        def register_tool_parsers():
            return [ToolParserSpec(name="sloppy", target=__name__ + ":Sloppy"),
                    ToolParserSpec(name="crashing", target=__name__ + ":Crashing")]
    """))
    args = ["parse", "--plugin", str(plugin), "--tool-parser", "sloppy"]
    assert CliRunner().invoke(cli, args, input="abc").exit_code == 0  # one piece: nothing to break
    broken = CliRunner().invoke(cli, [*args, "--chunk", "1"], input="abc")
    assert broken.exit_code == 1
    assert broken.stderr.strip() == ("error: the parser broke the streaming contract: "
                                     "tool call 0: only its first delta may carry id and name")
    crashed = CliRunner().invoke(cli, ["parse", "--plugin", str(plugin), "--tool-parser", "crashing"], input="abc")
    assert crashed.exit_code == 1 and crashed.stderr.strip() == "error: the parser failed: KeyError: 'oops'"
