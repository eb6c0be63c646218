"""``llmserve chat``: an interactive terminal chat over the OpenAI chat completions API.

It talks to a running server (``--url``) or starts ``llmserve serve MODEL`` as a child process
on a free loopback port (``llmserve chat MODEL``, or ``--local`` for the embedded model) and
stops it on exit. Replies stream token by token; the conversation is kept and sent with every
turn. Input: a line ending with ``\\`` continues on the next line; a ``\"\"\"`` line opens a block
that a line ending with ``\"\"\"`` closes. Commands: ``/system TEXT``, ``/reset``, ``/help``,
``/exit`` (or Ctrl-D). ``--quick TEXT`` prints one answer and exits.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any, Iterator, Optional, TextIO

import typer

from .remote import API_KEY_ENV, RemoteError, auth_headers, error_message, openai_base, pick_model, unreachable

DEFAULT_URL = "http://127.0.0.1:8000/v1"
HELP = """Commands:
  /system TEXT   set the system prompt (kept by /reset); /system alone shows it
  /reset         forget the conversation
  /help          this text
  /exit          quit (also /quit, /bye or Ctrl-D)
A line ending with \\ continues on the next line; \"\"\" opens a block that a line ending with \"\"\" closes.
Ctrl-C stops a reply that is streaming."""
_DIM, _RESET = "\x1b[2m", "\x1b[0m"


class Chat:
    """One conversation with one model: the history and the streaming request of each turn."""

    def __init__(self, base_v1: str, api_key: str | None, model: str, *, system: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None, out: TextIO = sys.stdout) -> None:
        import httpx

        self.url = f"{base_v1}/chat/completions"
        self.model, self.system, self.max_tokens, self.temperature = model, system, max_tokens, temperature
        self.history: list[dict[str, str]] = []
        self.out = out
        self.tty = out.isatty()
        self._http = httpx.Client(headers=auth_headers(api_key), timeout=httpx.Timeout(600.0, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def reset(self) -> None:
        self.history.clear()

    def _body(self) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        body: dict[str, Any] = {"model": self.model, "messages": system + self.history, "stream": True}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def _events(self) -> Iterator[dict[str, Any]]:
        """The stream's JSON events; ``RemoteError`` on a refusal, a lost server or an error event."""
        import httpx

        try:
            with self._http.stream("POST", self.url, json=self._body()) as response:
                if response.status_code != 200:
                    raise RemoteError(error_message(response.status_code, response.read(), self.url),
                                      response.status_code)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise RemoteError(f"{self.url} sent an event that is not JSON: {data[:80]!r}") from None
                    if not isinstance(event, dict):
                        continue
                    if "error" in event:
                        raise RemoteError(error_message(500, data, self.url))
                    yield event
        except httpx.HTTPError as exc:
            raise unreachable(self.url, exc) from None

    def ask(self, text: str) -> str:
        """Send ``text`` with the history, print the reply as it streams, keep both in the history.
        Ctrl-C keeps what arrived so far; a failed turn leaves the history as it was."""
        self.history.append({"role": "user", "content": text})
        reply: list[str] = []
        thinking = False
        try:
            for event in self._events():
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    reasoning, content = delta.get("reasoning_content"), delta.get("content")
                    if reasoning:
                        thinking = self._write_reasoning(reasoning, thinking)
                    if content:
                        if thinking:
                            thinking = self._end_reasoning()
                        reply.append(content)
                        self.out.write(content)
                        self.out.flush()
        except KeyboardInterrupt:
            if thinking:
                self._end_reasoning()
            self.out.write(" [interrupted]\n")
            self.out.flush()
            if not reply:  # nothing arrived: the turn is dropped, not kept as an empty reply
                self.history.pop()
                return ""
        except RemoteError:
            self.history.pop()
            if thinking:
                self._end_reasoning()
            if reply:
                self.out.write("\n")
            raise
        else:
            if thinking:  # reasoning and no answer
                self._end_reasoning()
            self.out.write("\n")
            self.out.flush()
        answer = "".join(reply)
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def _write_reasoning(self, text: str, started: bool) -> bool:
        """Reasoning is shown dimmed on a terminal; elsewhere it goes to stderr, apart from the answer."""
        if self.tty:
            self.out.write(("" if started else _DIM) + text)
            self.out.flush()
        else:
            sys.stderr.write(text)
        return True

    def _end_reasoning(self) -> bool:
        if self.tty:
            self.out.write(_RESET + "\n")
        else:
            sys.stderr.write("\n")
        return False


def read_message(prompt: str = ">>> ", more: str = "... ") -> str:
    """One message from the terminal: ``\\`` at the end of a line continues it; a ``\"\"\"`` line
    opens a block that a line ending with ``\"\"\"`` closes. ``EOFError`` on Ctrl-D."""
    line = input(prompt)
    if line.lstrip().startswith('"""'):
        rest = line.lstrip()[3:]
        lines = []
        while not rest.rstrip().endswith('"""'):
            lines.append(rest)
            rest = input(more)
        lines.append(rest.rstrip()[:-3])
        return "\n".join(lines).strip("\n")
    parts = []
    while line.endswith("\\"):
        parts.append(line[:-1])
        line = input(more)
    parts.append(line)
    return "\n".join(parts)


def command(chat: Chat, line: str) -> bool:
    """Run a ``/command``; False when the chat should end."""
    name, _, arg = line.strip().partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/reset" or name == "/clear":
        chat.reset()
        print("(conversation cleared)")
    elif name == "/system":
        if arg.strip():
            chat.system = arg.strip()
            print("(system prompt set)")
        else:
            print(f"(system prompt: {chat.system!r})" if chat.system else "(no system prompt)")
    elif name in ("/help", "/?"):
        print(HELP)
    else:
        print(f"unknown command {name}; /help lists them")
    return True


def repl(chat: Chat) -> None:
    """Read messages and commands until /exit or Ctrl-D."""
    try:
        import readline  # noqa: F401 - line editing and history for input(), where the platform has it
    except ImportError:
        pass
    while True:
        try:
            text = read_message()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)")
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            if not command(chat, text):
                return
            continue
        try:
            chat.ask(text)
        except RemoteError as exc:
            print(f"error: {exc}", file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``llmserve serve MODEL`` in a child process on a free loopback port; returns it and its
    base URL once ``/ready`` answers 200. Its log goes to this process's stderr."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "llmserve", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *extra]
    root = f"http://127.0.0.1:{port}"
    print(f"loading {model or 'the embedded model'} in a child server at {root} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno())
    while True:
        code = proc.poll()
        if code is not None:
            raise RemoteError(f"`llmserve serve` for {model or 'the embedded model'} exited with status {code} "
                              "(its error is above)")
        try:
            if httpx.get(f"{root}/ready", timeout=2).status_code == 200:
                return proc, f"{root}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def stop_local_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def chat_command(
    model_path: Optional[str] = typer.Argument(
        None, metavar="[MODEL]", help="Model directory or .gguf file to load in a child server (instead of --url)."),
    url: Optional[str] = typer.Option(None, "--url", help="OpenAI base URL of a running server.",
                                      show_default=DEFAULT_URL),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                          help="API key sent as Authorization: Bearer KEY."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name.",
                                         show_default="the server's first model"),
    local: bool = typer.Option(False, "--local", help="Start a child server with the embedded model."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Most tokens per reply."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0, help="Sampling temperature."),
    quick: Optional[str] = typer.Option(None, "--quick", "-q", help="Send this one message, print the answer, exit."),
    serve_arg: Optional[list[str]] = typer.Option(
        None, "--serve-arg", help="Extra flag for the child server, e.g. --serve-arg=--dtype=float32; repeatable."),
) -> None:
    """Chat with a model in the terminal: a running server (--url) or one started here (MODEL or --local)."""
    if (model_path or local) and url:
        _fail("give MODEL (or --local) or --url, not both")
    proc = None
    try:
        if model_path or local:
            proc, base = start_local_server(model_path, serve_arg or [])
        else:
            base = openai_base(url or DEFAULT_URL)
        name = pick_model(base, api_key, model)
        chat = Chat(base, api_key, name, system=system, max_tokens=max_tokens, temperature=temperature)
        try:
            if quick is not None:
                chat.ask(quick)
                return
            print(f"Chatting with {name} at {base}. /help for commands, /exit or Ctrl-D to quit.")
            repl(chat)
        finally:
            chat.close()
    except RemoteError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if proc is not None:
            stop_local_server(proc)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
