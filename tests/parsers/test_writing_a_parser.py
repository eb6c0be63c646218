"""The examples of docs/writing-a-parser.md work as printed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmserve.parsing.chain import ParseChain
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-parser.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def block_with(lang: str, marker: str) -> str:
    found = [b for b in blocks(lang) if marker in b]
    assert len(found) == 1, f"expected one ```{lang} block containing {marker!r}"
    return found[0]


@pytest.fixture
def example(tmp_path, monkeypatch):
    path = tmp_path / "function_tag.py"
    path.write_text(block_with("python", "# function_tag.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    for name in [m for m in sys.modules if m.endswith("function_tag")]:
        del sys.modules[name]


CASES = [
    ("plain text, no call < here", "plain text, no call < here", []),
    ('Checking.<function=get_weather>{"city": "Paris"}</function>', "Checking.",
     [("get_weather", '{"city": "Paris"}')]),
    ('<function=a>{"x": {"y": [1, "é}"]}}</function><function=b></function> done', " done",
     [("a", '{"x": {"y": [1, "é}"]}}'), ("b", "{}")]),
    ("<function=bad name>{}</function>", "<function=bad name>{}</function>", []),
    ('ok <function=get_weather>{"city": "Pa', 'ok <function=get_weather>{"city": "Pa', []),
]


def structure(result):
    return result["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in result["tool_calls"]]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_the_worked_example_through_the_registry(example, text, content, calls):
    pm = PluginManager().load([(str(example), "cli")], autoload=False)
    parser_cls = Registry.collect(pm).load("tool_parser", "function_tag")
    assert structure(ParseChain(parser_cls()).parse(text)) == (content or None, calls)
    for k in range(len(text) + 1):
        chain = ParseChain(parser_cls(), strict=True)
        chain.feed(text[:k])
        chain.feed(text[k:])
        chain.finish()
        assert structure(chain.result()) == (content or None, calls)


def test_the_testing_section_runs(example):
    namespace: dict = {}
    exec(compile(block_with("python", "def test_chunking_does_not_matter"), "doc", "exec"), namespace)
    namespace["test_chunking_does_not_matter"]()


def test_the_console_example(example):
    from llmserve.cli import cli

    console = block_with("console", "llmserve parse")
    stdin = re.search(r"printf '%s' '(.*?)'", console).group(1)
    printed = json.loads(console.strip().splitlines()[-1].replace("call_...", "call_x"))
    result = CliRunner().invoke(cli,
                                ["parse", "--plugin", str(example), "--tool-parser", "function_tag", "--chunk", "1"],
                                input=stdin)
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert structure(got) == structure(printed) and got["reasoning_content"] is None


def test_the_helper_based_parser():
    namespace: dict = {}
    exec(compile(block_with("python", "class CallTagParser"), "doc", "exec"), namespace)
    text = 'Hi <call>{"name": "f", "arguments": {"a": 1}}</call><call>[{"name": "g", "arguments": {}}]</call>'
    result = ParseChain(namespace["CallTagParser"]()).parse(text)
    assert structure(result) == ("Hi", [("f", '{"a": 1}'), ("g", "{}")])


def test_the_reasoning_example():
    namespace: dict = {}
    exec(compile(block_with("python", "class SeedThinkParser"), "doc", "exec"), namespace)
    parser = namespace["SeedThinkParser"]
    assert ParseChain(None, parser()).parse("<seed:think>hm</seed:think>Yes.")["reasoning_content"] == "hm"
    assert ParseChain(None, parser()).parse("Just yes.") == {"content": "Just yes.", "reasoning_content": None,
                                                              "tool_calls": []}
