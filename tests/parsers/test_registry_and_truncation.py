"""Registration of the built-in parsers, and the truncation property: every prefix of every
case (an output cut off anywhere, as by max_tokens) parses the same whole and in pieces."""

from __future__ import annotations

import pytest

from llmserve.parsing.contract import ReasoningParser, ToolParser
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry

from .cases import ALL_CASES, case_id
from .helpers import Case, check_arguments, pieces, random_chunks, whole

TOOL_PARSERS = sorted(["glm45", "glm47", "granite", "hermes", "internlm", "jamba", "llama3_json", "minimax_m2",
                       "mistral", "pythonic", "qwen3_coder", "seed_oss",
                       "deepseek_v3", "deepseek_v31", "kimi_k2", "lfm2", "openai", "phi4_mini_json"])
REASONING_PARSERS = sorted(["deepseek_r1", "glm45", "minimax_m2", "qwen3", "seed_oss",
                            "deepseek_v3", "granite", "kimi_k2", "mistral", "openai_gptoss"])
# Harmony frames every message, call or not: the openai parser drops the framing of the others.
FRAMED = {"openai"}


def test_builtin_parsers_are_registered_by_one_plugin():
    pm = PluginManager().load(autoload=False)
    reg = Registry.collect(pm)
    assert reg.names("tool_parser") == TOOL_PARSERS
    assert reg.names("reasoning_parser") == REASONING_PARSERS
    assert reg.get("tool_parser", "llama4_json").record is reg.get("tool_parser", "llama3_json").record
    assert reg.get("tool_parser", "qwen3_xml").record is reg.get("tool_parser", "qwen3_coder").record
    info = pm.infos["parsers"]
    assert info.source == "builtin" and info.module == "llmserve.plugins.tool_parsers"
    assert sorted(info.contributes["tool_parser"]) == TOOL_PARSERS
    assert sorted(info.contributes["reasoning_parser"]) == REASONING_PARSERS
    for name in TOOL_PARSERS:
        cls = reg.load("tool_parser", name)
        assert issubclass(cls, ToolParser)
    for name in REASONING_PARSERS:
        assert issubclass(reg.load("reasoning_parser", name), ReasoningParser)


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_every_prefix_streams_like_it_parses(case):
    for k in range(len(case.text) + 1):
        cut = Case(case.id, case.text[:k], tool_parser=case.tool_parser, reasoning_parser=case.reasoning_parser,
                   tools=case.tools, template_kwargs=case.template_kwargs)
        expected = whole(cut)
        check_arguments(expected)
        if not case.reasoning_parser and not expected["tool_calls"] and case.tool_parser not in FRAMED:
            assert expected["content"] == (cut.text or None)  # no call: the text is all content
        assert pieces(cut, random_chunks(cut.text, k)) == expected, cut.text
