"""The acme tool-call format: lines `CALL name {json arguments}`; anything else is content."""

import json
import uuid

from llmserve import ParseDelta, ToolCallDelta, ToolParser


class AcmeToolParser(ToolParser):
    def __init__(self, tokenizer=None, tools=None):
        super().__init__(tokenizer, tools)
        self._line = ""
        self._calls = 0

    def _take_line(self, line: str) -> ParseDelta:
        if line.startswith("CALL "):
            name, _, args = line[5:].partition(" ")
            try:
                parsed = json.loads(args or "{}")
            except json.JSONDecodeError:
                parsed = None
            if name and isinstance(parsed, dict):
                call = ToolCallDelta(self._calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                                     arguments=json.dumps(parsed, ensure_ascii=False))
                self._calls += 1
                return ParseDelta(tool_calls=[call])
        return ParseDelta(content=line)

    def feed(self, text, token_ids=()):
        out = ParseDelta()
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            part = self._take_line(line)
            out.content += part.content + ("\n" if part.content or not part.tool_calls else "")
            out.tool_calls += part.tool_calls
        return out

    def finish(self):
        line, self._line = self._line, ""
        return self._take_line(line) if line else ParseDelta()
