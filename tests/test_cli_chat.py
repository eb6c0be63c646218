"""``llmserve chat`` end to end: driven through a pseudo-terminal (pexpect) against the real
embedded SmolLM2 server, with the server's own token counters (/metrics) as the witness that
each turn carries the conversation so far, that ``/reset`` forgets it and that multi-line input
arrives whole; ``--quick`` answers exactly what the API answers; failures are one line."""

from __future__ import annotations

import os
import re
import sys
import time

import httpx
import pytest

from conftest import ECHO_PLUGIN, ROOT, free_port, run_cli

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "


def counters(url: str) -> tuple[float, float]:
    """(prompt tokens, generated tokens) of every finished request so far."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"]


class Turns:
    """The server's counters around each chat turn: (prompt tokens, generated tokens) it took."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last = counters(url)

    def taken(self) -> tuple[int, int]:
        deadline = time.time() + 30
        while True:  # the engine publishes its counters after the step that finished the turn
            now = counters(self.url)
            if now[0] > self.last[0] or time.time() > deadline:
                break
            time.sleep(0.1)
        delta = (int(now[0] - self.last[0]), int(now[1] - self.last[1]))
        self.last = now
        return delta


def spawn_chat(*args: str):
    env = {k: v for k, v in os.environ.items() if k not in ("LLMSERVE_API_KEY", "OPENAI_API_KEY")}
    child = pexpect.spawn(sys.executable, ["-m", "llmserve", "chat", *args], cwd=str(ROOT), env=env,
                          encoding="utf-8", timeout=180, dimensions=(40, 200))
    return child


def say(child, *lines: str) -> str:
    """Type ``lines`` (one message, or a command) and return what came back before the next prompt."""
    for line in lines:
        child.sendline(line)
    child.expect_exact(PROMPT)
    return child.before


def test_two_turns_carry_history_reset_forgets_and_multiline_arrives_whole(smollm_server):
    url = smollm_server.url
    child = spawn_chat("--url", url, "--max-tokens", "6", "--temperature", "0")
    try:
        child.expect_exact("Chatting with SmolLM2-135M-Instruct")
        child.expect_exact(PROMPT)
        turns = Turns(url)

        say(child, "Say hello.")
        first_prompt, first_reply = turns.taken()
        assert first_prompt > 0 and 0 < first_reply <= 6
        say(child, "Say hello.")
        second_prompt, _ = turns.taken()
        # The same message again, now after the first turn's user and assistant messages.
        assert second_prompt >= first_prompt + first_reply

        assert "(conversation cleared)" in say(child, "/reset")
        say(child, "Say hello.")
        assert turns.taken()[0] == first_prompt  # the history is gone: the first prompt exactly

        say(child, "/reset")
        say(child, '"""', "Say hello.", 'And then goodbye."""')
        block_prompt, _ = turns.taken()
        assert block_prompt > first_prompt  # both lines reached the server
        say(child, "/reset")
        say(child, "Say hello.\\", "And then goodbye.")
        assert turns.taken()[0] == block_prompt  # a continued line is the same two-line message

        say(child, "/system You answer like a pirate.")
        say(child, "/reset")  # keeps the system prompt
        say(child, "Say hello.")
        assert turns.taken()[0] != first_prompt  # the template's default system prompt was replaced

        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_quick_prints_the_answer_the_api_gives_and_exits(smollm_server):
    args = ["--max-tokens", "8", "--temperature", "0", "--system", "You are terse."]
    out = run_cli("chat", "--url", smollm_server.url + "/v1", "--quick", "Name a colour.", *args, timeout=300)
    assert out.returncode == 0, out.stderr
    r = httpx.post(smollm_server.url + "/v1/chat/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]})
    expected = r.json()["choices"][0]["message"]["content"]
    assert expected.strip() and out.stdout == expected + "\n"


def test_unreachable_server_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    out = run_cli("chat", "--url", url, "--quick", "hi", env={"LLMSERVE_API_KEY": ""})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach a server at {url}/v1" in lines[0] and "--url" in lines[0]
    assert out.stdout == ""


def test_a_server_with_keys_asks_for_api_key(server_process):
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--api-key", "sesame")
    out = run_cli("chat", "--url", server.url, "--quick", "hi", env={"LLMSERVE_API_KEY": "", "OPENAI_API_KEY": ""})
    assert out.returncode == 1
    assert "HTTP 401" in out.stderr and "--api-key" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # With the key the request gets through to the chat route, which says (in one line, too) that
    # the echo model has no chat template: the server's own message, not a traceback.
    out = run_cli("chat", "--url", server.url, "--quick", "hi", "--api-key", "sesame")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: HTTP 400 from {server.url}/v1/chat/completions: "
        "this model has no chat template; send a chat_template or use completions"]


def test_local_starts_a_child_server_and_stops_it_on_exit():
    out = run_cli("chat", "--quick", "Say hi.", "--max-tokens", "3", "--local",
                  "--serve-arg=--max-model-len=512", "--serve-arg=--dtype=float32", timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    match = re.search(r"loading the embedded model in a child server at (http://127.0.0.1:\d+)", out.stderr)
    assert match, out.stderr
    with pytest.raises(httpx.ConnectError):  # the child server is gone with the chat
        httpx.get(match.group(1) + "/health", timeout=5)
