"""qwen3_coder (alias qwen3_xml): Qwen3-Coder, Qwen3.5 and Qwen3.6 write each call as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are bare text typed from the request's tool schema (``xml_params.typed_value``), one
newline dropped on each side as the template writes them. Several blocks are parallel calls; a
block may hold several functions. A block that is not complete calls (cut off, a missing
``</parameter>`` or ``</function>``, prose) is content, verbatim; a missing ``</tool_call>``
after complete functions at the end of the output is accepted.
"""

from __future__ import annotations

from llmserve.plugins.tool_parsers.forced_xml import XmlFamilyParser, XmlLayout
from llmserve.plugins.tool_parsers.xml_params import read_functions

# The template's layout: a newline on each side of a value, one after each closing tag.
_LAYOUT = XmlLayout(opener="<tool_call>\n", closer="</tool_call>", head="<function={}>\n",
                    param=("<parameter={}>\n", "\n</parameter>\n"), tail="</function>\n",
                    words=("</parameter>", "<tool_call>", "</tool_call>"))


class Qwen3CoderToolParser(XmlFamilyParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    layout = _LAYOUT
    read_region = staticmethod(read_functions)
