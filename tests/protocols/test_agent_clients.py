"""The agent clients people point at local servers, against a plain ``llmserve serve`` (no tool
flags: the model's template shows Hermes' format, so tool calling is on by detection): Claude
Code (``claude -p``, over the Anthropic dialect), Codex (``codex exec``, over Responses) and the
openai-agents SDK (over Chat Completions and Responses). The model is the scripted ``agent``
test backend: asked to read a file, it calls the client's own file tool, then answers with the
word the tool returned, so each client completes a session with a real tool round trip (the
client runs the tool) and prints the answer. The CLIs come from npm (``make test`` installs them
under ``.agents/``) and never reach the network: telemetry and update checks are off, and their
home is a fresh temporary folder."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess

AGENTS = ROOT / ".agents" / "node_modules"
CLAUDE = AGENTS / "@anthropic-ai" / "claude-code-linux-x64" / "claude"
CODEX = AGENTS / "@openai" / "codex-linux-x64" / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"
WORD = "PINEAPPLE"
QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
         "DISABLE_ERROR_REPORTING": "1", "NO_COLOR": "1", "OPENAI_AGENTS_DISABLE_TRACING": "1"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--backend", "agent", "--plugin", "tests/plugins/agent_backend.py")
    try:
        yield proc.wait_ready(timeout=120)
    finally:
        proc.stop()


@pytest.fixture
def workspace(tmp_path):
    """A fresh home for the CLI and a file whose word only a tool call can find."""
    (tmp_path / "home").mkdir()
    secret = tmp_path / "work" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(f"The secret word is {WORD}.\n")
    return tmp_path, secret


def ask(path: Path) -> str:
    return f"Use a tool to read the file {path} and tell me the word in it."


def run_cli(args: list[str], tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "HOME": str(tmp / "home"), **QUIET, **env}
    return subprocess.run(args, cwd=tmp / "work", env=full, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)


def sessions(server, route: str) -> list[int]:
    """Prompt token counts of the server's access lines for ``route``, in order."""
    return [int(m) for m in re.findall(rf'route="POST {route}" status=200 prompt_tokens=(\d+)', server.log)]


def binary(path: Path) -> str:
    if not path.exists():
        pytest.fail(f"{path} is missing: `make test` installs the agent CLIs under .agents/")
    return str(path)


def test_claude_code_reads_a_file_with_its_tool(server, workspace):
    tmp, secret = workspace
    before = len(sessions(server, "/v1/messages"))
    done = run_cli([binary(CLAUDE), "-p", ask(secret), "--allowedTools", "Read", "--output-format", "text"], tmp,
                   {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-local"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"The word is: {WORD}." in done.stdout
    turns = sessions(server, "/v1/messages")[before:]
    # The call, then the answer after the tool's result: a prompt of Claude Code's length (its
    # system prompt and two dozen tools), the second one longer by the call and its result.
    assert len(turns) >= 2 and turns[0] > 10_000 and turns[-1] > turns[0], turns
    assert "tool_choice" not in server.log  # no 400 about tool flags along the way


def test_codex_exec_reads_a_file_with_its_shell_tool(server, workspace):
    tmp, secret = workspace
    before = len(sessions(server, "/v1/responses"))
    provider = f'model_providers.llmserve={{name="llmserve",base_url="{server.url}/v1",wire_api="responses"}}'
    done = run_cli([binary(CODEX), "exec", "--skip-git-repo-check", "-c", provider, "-c", "model_provider=llmserve",
                    "-m", "agent", "--dangerously-bypass-approvals-and-sandbox", ask(secret)], tmp, {})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"The word is: {WORD}." in done.stdout
    turns = sessions(server, "/v1/responses")[before:]
    assert len(turns) >= 2 and turns[-1] > turns[0], turns
    # Codex offers hosted tools beside its functions: left out with a warning, not refused.
    assert "runs only on OpenAI's servers; left out" in server.log


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_function_tool(server, workspace, api):
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    _, secret = workspace
    read: list[str] = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a text file and return its contents."""
        read.append(path)
        return Path(path).read_text()

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-local", max_retries=0)
    kind = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(name="reader", instructions="You read files for the user.", tools=[read_file],
                  model=kind(model="agent", openai_client=client))
    result = asyncio.run(Runner.run(agent, ask(secret), max_turns=4))
    assert read == [str(secret)]
    assert result.final_output == f"The word is: {WORD}."
