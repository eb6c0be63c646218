"""minimax_m2: MiniMax-M2 writes calls as

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

one block holding one ``<invoke>`` per call (several are parallel calls). Names may be quoted
with ``"`` or ``'`` or bare. Values are bare text typed from the request's tool schema
(``xml_params.typed_value``), kept exactly as written otherwise. A block that is not complete
calls (cut off, a tag left open) is content, verbatim; a missing ``</minimax:tool_call>``
after complete invokes at the end of the output is accepted.
"""

from __future__ import annotations

from llmserve.plugins.tool_parsers.forced_xml import XmlFamilyParser, XmlLayout
from llmserve.plugins.tool_parsers.xml_params import Call, plain_name, read_tagged_calls

# The template's layout: names quoted, no newline around a value, one after each closing tag;
# one block per call, each holding its <invoke>.
_LAYOUT = XmlLayout(opener="<minimax:tool_call>\n", closer="</minimax:tool_call>", head='<invoke name="{}">\n',
                    param=('<parameter name="{}">', "</parameter>\n"), tail="</invoke>\n",
                    words=("</parameter>", "</invoke>", "<minimax:tool_call>", "</minimax:tool_call>"))


def _unquote(name: str) -> str | None:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1]
    return plain_name(name)


def read_invokes(text: str) -> list[Call] | None:
    """``<invoke name="N"><parameter name="K">V</parameter>...</invoke>``, one or more."""
    return read_tagged_calls(text, ("<invoke name=", "</invoke>", "<parameter name="), _unquote)


class MiniMaxM2ToolParser(XmlFamilyParser):
    start_markers = ("<minimax:tool_call>",)
    end_marker = "</minimax:tool_call>"
    layout = _LAYOUT
    read_region = staticmethod(read_invokes)
