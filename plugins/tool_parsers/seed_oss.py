"""seed_oss: Seed-OSS writes calls as

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>

The body is Qwen3-Coder's (``xml_params.read_functions``), values typed from the request's
tool schema; the same rules for broken and cut-off blocks (content, verbatim).
"""

from __future__ import annotations

from typing import Any

from llmserve.plugins.tool_parsers.forced_xml import xml_block_calls
from llmserve.plugins.tool_parsers.xml_params import Call, XmlToolParser, read_functions

# The template's layout: no newline around a value, one after each closing tag.
_CALL = {"head": "<function={}>\n", "param": ("<parameter={}>", "</parameter>\n"), "tail": "</function>\n"}
_WORDS = ("</parameter>", "<seed:tool_call>", "</seed:tool_call>")  # what a forced value may not hold


class SeedOssToolParser(XmlToolParser):
    start_markers = ("<seed:tool_call>",)
    end_marker = "</seed:tool_call>"

    def read_region(self, text: str) -> list[Call] | None:
        return read_functions(text)

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        """Forced calls as the Seed-OSS template writes them (``forced_xml``), one block each."""
        return xml_block_calls(tools, name, parallel,
                               opener="<seed:tool_call>\n", closer="</seed:tool_call>",
                               layout=_CALL, words=_WORDS)
