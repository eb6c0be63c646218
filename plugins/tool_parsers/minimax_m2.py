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

from llmserve.plugins.tool_parsers.xml_params import Call, XmlToolParser, between, plain_name, skip_space


def _unquote(name: str) -> str | None:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1]
    return plain_name(name)


def read_invokes(text: str) -> list[Call] | None:
    """``<invoke name="N"><parameter name="K">V</parameter>...</invoke>``, one or more."""
    calls: list[Call] = []
    i = skip_space(text, 0)
    while i < len(text):
        got = between(text, i, "<invoke name=", ">")
        name = _unquote(got[0]) if got else None
        if got is None or name is None:
            return None
        i, pairs = got[1], []
        while True:
            i = skip_space(text, i)
            if text.startswith("</invoke>", i):
                i += len("</invoke>")
                break
            head = between(text, i, "<parameter name=", ">")
            key = _unquote(head[0]) if head else None
            if head is None or key is None:
                return None
            end = text.find("</parameter>", head[1])
            if end < 0:
                return None
            pairs.append((key, text[head[1]:end]))
            i = end + len("</parameter>")
        calls.append((name, pairs))
        i = skip_space(text, i)
    return calls or None


class MiniMaxM2ToolParser(XmlToolParser):
    start_markers = ("<minimax:tool_call>",)
    end_marker = "</minimax:tool_call>"

    def read_region(self, text: str) -> list[Call] | None:
        return read_invokes(text)
