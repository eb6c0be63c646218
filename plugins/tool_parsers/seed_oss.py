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

from llmserve.plugins.tool_parsers.xml_params import Call, XmlToolParser, read_functions


class SeedOssToolParser(XmlToolParser):
    start_markers = ("<seed:tool_call>",)
    end_marker = "</seed:tool_call>"

    def read_region(self, text: str) -> list[Call] | None:
        return read_functions(text)
