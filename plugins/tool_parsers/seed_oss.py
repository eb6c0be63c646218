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

from llmserve.plugins.tool_parsers.forced_xml import XmlFamilyParser, XmlLayout
from llmserve.plugins.tool_parsers.xml_params import read_functions

# The template's layout: no newline around a value, one after each closing tag.
_LAYOUT = XmlLayout(opener="<seed:tool_call>\n", closer="</seed:tool_call>", head="<function={}>\n",
                    param=("<parameter={}>", "</parameter>\n"), tail="</function>\n",
                    words=("</parameter>", "<seed:tool_call>", "</seed:tool_call>"))


class SeedOssToolParser(XmlFamilyParser):
    start_markers = ("<seed:tool_call>",)
    end_marker = "</seed:tool_call>"
    layout = _LAYOUT
    read_region = staticmethod(read_functions)
