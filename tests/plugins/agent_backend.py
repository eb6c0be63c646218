"""A test plugin contributing the ``agent`` backend: a scripted model for agent CLIs (Claude
Code, Codex) against a plain ``llmserve serve``.

It reads the prompt its chat template rendered (UTF-8 bytes as tokens, kept in block slots as
the echo backend keeps them, so prefix-cache hits are exercised) and answers as a model that
uses one tool would: asked to read a ``*.txt`` file, it calls the client's file-reading tool
(Claude Code's ``Read``, Codex's shell tool) in Hermes' ``<tool_call>`` format; once the last
turn is that tool's result, it answers ``The word is: <first word of the result>.``; anything
else gets ``OK.``. The template shows Hermes' markers, so the server detects the ``hermes``
parser at start and tool calling is on with no flags.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from llmserve import hookimpl
from llmserve.engine.backend import KVCacheSpec, ModelInfo, StepItem, StepResult
from llmserve.hooks.records import BackendSpec


def _sibling(name: str):
    """A plugin file beside this one, as a module (plugin files are loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"agent_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_echo = _sibling("echo_backend")
EOS, ByteTokenizer, EchoBackend = _echo.EOS, _echo.ByteTokenizer, _echo.EchoBackend

TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content if m.content is string else m.content | tojson }}\n{% endif %}"
    "{%- if loop.first and tools %}<|tools|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

FILE = re.compile(r"(/[\w./-]+\.txt)")


def tool_names(prompt: str) -> list[str]:
    """The tool names the rendered ``<|tools|>`` section offers (Chat Completions' shape or a flat one)."""
    names = []
    for line in prompt.partition("<|tools|>")[2].split("\n"):
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            names.append(spec["name"])
    return names


def call(names: list[str], path: str) -> dict | None:
    """The call that reads ``path`` with the client's own tool, if it offers one this script knows."""
    if "Read" in names:  # Claude Code
        return {"name": "Read", "arguments": {"file_path": path}}
    if "read_file" in names:  # the openai-agents SDK test's own function tool
        return {"name": "read_file", "arguments": {"path": path}}
    if "exec_command" in names:  # Codex's unified exec tool
        return {"name": "exec_command", "arguments": {"cmd": f"cat {path}"}}
    if "shell_command" in names:
        return {"name": "shell_command", "arguments": {"command": f"cat {path}"}}
    if "shell" in names:
        return {"name": "shell", "arguments": {"command": ["cat", path]}}
    return None


def script(prompt: str) -> str:
    """What the scripted model says after ``prompt``."""
    last_user, last_tool = prompt.rfind("<|user|>"), prompt.rfind("<|tool|>")
    if last_tool > last_user:
        result = prompt[last_tool:].partition("<tool_response>")[2].rpartition("</tool_response>")[0]
        words = re.findall(r"[A-Za-z][A-Za-z0-9_-]{3,}", result)
        word = next((w for w in words if w.isupper()), words[0] if words else "nothing")
        return f"The word is: {word}."
    asked = FILE.findall(prompt[last_user:]) if last_user >= 0 else []
    chosen = call(tool_names(prompt), asked[-1]) if asked else None
    if chosen is not None:
        return "<tool_call>" + json.dumps(chosen) + "</tool_call>"
    return "OK."


class AgentTokenizer(ByteTokenizer):
    chat_template = TEMPLATE


class AgentBackend(EchoBackend):
    """The echo backend's token slots, with ``script``'s reply instead of the prompt."""

    def load(self) -> ModelInfo:
        self.replies: dict[int, list[int]] = {}
        return ModelInfo(name="agent", path="agent://", max_model_len=self.config.llm.max_model_len or 262144,
                         vocab_size=257, eos_token_ids=[EOS], tokenizer=AgentTokenizer())

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        return super().init_kv_cache(KVCacheSpec(spec.block_size, spec.num_blocks or spec.min_blocks * 2,
                                                 spec.memory_fraction, spec.min_blocks))

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        out = []
        for item in batch:
            for i, tok in enumerate(item.token_ids):
                self.slots[self._slot(item.block_table, item.start_pos + i)] = tok
            if not item.sample:
                out.append(StepResult(item.seq_id))
                continue
            n_out = len(item.output_ids)
            if n_out == 0 or item.seq_id not in self.replies:
                end = item.start_pos + len(item.token_ids) - n_out
                prompt = bytes(self.slots[self._slot(item.block_table, p)] for p in range(end))
                self.replies[item.seq_id] = list(script(prompt.decode("utf-8", errors="replace")).encode())
            reply = self.replies[item.seq_id]
            out.append(StepResult(item.seq_id, token_id=reply[n_out] if n_out < len(reply) else EOS, logprob=-0.5))
        return out

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.replies.pop(seq_id, None)


@hookimpl
def register_backends() -> list[BackendSpec]:
    return [BackendSpec(name="agent", target=f"{__name__}:AgentBackend",
                        description="test backend: a scripted model that reads a file with the client's tool")]
