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

from typing import Any

from llmserve.plugins.tool_parsers.forced_xml import xml_block_calls
from llmserve.plugins.tool_parsers.xml_params import Call, XmlToolParser, between, plain_name, skip_space

# GLM-4.5/4.6's layout (the reader takes 4.7's too): the name, then one key/value pair per line.
_CALL = {"head": "{}\n", "param": ("<arg_key>{}</arg_key>\n<arg_value>", "</arg_value>\n"), "tail": ""}
_WORDS = ("</arg_value>", "<arg_key>", "<tool_call>", "</tool_call>")  # what a forced value may not hold


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


class Glm45ToolParser(XmlToolParser):
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def read_region(self, text: str) -> list[Call] | None:
        return read_glm_call(text)

    @classmethod
    def forced_calls(cls, tools: list[dict[str, Any]], name: str | None = None,
                     parallel: bool = True) -> dict[str, Any] | None:
        """Forced calls as the GLM-4.5/4.6 template writes them (``forced_xml``), one block each."""
        return xml_block_calls(tools, name, parallel,
                               opener="<tool_call>", closer="</tool_call>",
                               layout=_CALL, words=_WORDS)
