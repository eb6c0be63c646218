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

from typing import Any

from llmserve.plugins.tool_parsers.forced_xml import xml_block_calls
from llmserve.plugins.tool_parsers.xml_params import Call, XmlToolParser, read_functions

_CALL = {"head": "<function={}>\n", "param": ("<parameter={}>\n", "\n</parameter>\n"), "tail": "</function>\n"}
_WORDS = ("</parameter>", "<tool_call>", "</tool_call>")  # what a forced value may not hold


class Qwen3CoderToolParser(XmlToolParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def read_region(self, text: str) -> list[Call] | None:
        return read_functions(text)

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        """Forced calls as the Qwen3-Coder template writes them (``forced_xml``), one block each."""
        return xml_block_calls(tools, name, parallel,
                               opener="<tool_call>\n", closer="</tool_call>",
                               layout=_CALL, words=_WORDS)
