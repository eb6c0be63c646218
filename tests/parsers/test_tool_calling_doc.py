"""docs/tool-calling.md: every example prints what the page says, and every parser is described."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmserve.cli import cli

from .helpers import registry, structure

DOC = Path(__file__).resolve().parents[2] / "docs" / "tool-calling.md"
EXAMPLE = re.compile(r"<!-- parse: (.*?) -->\s*```text\n(.*?)\n```\s*```json\n(.*?)\n```", re.S)


def examples():
    return EXAMPLE.findall(DOC.read_text())


def test_the_page_has_examples_for_every_parser():
    used = " ".join(args for args, _, _ in examples())
    for kind, flag in (("tool_parser", "--tool-parser"), ("reasoning_parser", "--reasoning-parser")):
        for name in registry().names(kind):
            assert f"{flag} {name}" in used, name
            assert re.search(rf"^### {name}\b|\*\*`{name}`\*\*", DOC.read_text(), re.M), name


@pytest.mark.parametrize("args,text,printed", examples(), ids=lambda v: v[:30] if isinstance(v, str) else v)
def test_example_output(args, text, printed):
    for chunk in ([], ["--chunk", "1"]):
        result = CliRunner().invoke(cli, ["parse", *shlex.split(args), *chunk], input=text.encode())
        assert result.exit_code == 0, result.output
        assert structure(json.loads(result.stdout)) == structure(json.loads(printed))


def test_console_example():
    block = re.search(r"```console\n\$ printf '%s' '(.*?)' \| llmserve parse (.*?)\n(.*?)\n```", DOC.read_text(), re.S)
    text, args, printed = block.groups()
    result = CliRunner().invoke(cli, ["parse", *shlex.split(args)], input=text.encode())
    assert structure(json.loads(result.stdout)) == structure(json.loads(printed))
