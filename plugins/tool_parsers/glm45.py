"""glm45 and glm47: GLM-4.5/4.6 and GLM-4.7 write one call per block,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

the name first, then key/value pairs; values are bare text (the templates write non-string
arguments as JSON) typed from the request's tool schema (``xml_params.typed_value``), kept
exactly as written otherwise. GLM-4.7's template differs in layout only: no newline after the
name or between pairs (``<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris
</arg_value></tool_call>``), and a call without arguments is ``<tool_call>get_time</tool_call>``.
One class reads both layouts; glm47 is a second name for it, so vLLM's flag values carry over. A block
that is not one complete call (cut off, a pair left open, a name with spaces) is content,
verbatim; a missing ``</tool_call>`` after a complete call at the end of the output is accepted.
"""

from __future__ import annotations

from llmserve.plugins.tool_parsers.forced_xml import XmlFamilyParser, XmlLayout
from llmserve.plugins.tool_parsers.xml_params import Call, between, plain_name, skip_space

# GLM-4.5/4.6's layout (the reader takes 4.7's too): the name, then one key/value pair per line.
_LAYOUT = XmlLayout(opener="<tool_call>", closer="</tool_call>", head="{}\n",
                    param=("<arg_key>{}</arg_key>\n<arg_value>", "</arg_value>\n"), tail="",
                    words=("</arg_value>", "<arg_key>", "<tool_call>", "</tool_call>"))


def read_glm_call(text: str) -> list[Call] | None:
    """The one call of a GLM block: ``NAME (<arg_key>K</arg_key><arg_value>V</arg_value>)*``."""
    first = text.find("<arg_key>")
    name = plain_name(text if first < 0 else text[:first])
    if name is None:
        return None
    pairs: list[tuple[str, str]] = []
    i = len(text) if first < 0 else first
    while True:
        i = skip_space(text, i)
        if i == len(text):
            return [(name, pairs)]
        key = between(text, i, "<arg_key>", "</arg_key>")
        value = between(text, key[1], "<arg_value>", "</arg_value>") if key else None
        if key is None or value is None or not key[0].strip():
            return None
        pairs.append((key[0].strip(), value[0]))
        i = value[1]


class Glm45ToolParser(XmlFamilyParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    layout = _LAYOUT
    read_region = staticmethod(read_glm_call)
