"""Every shell example in README.md and docs/ runs as written, and prints what the doc shows.

The fenced ``sh``, ``bash``, ``console`` and ``shell`` blocks of each page (and ``text`` blocks
that open with a ``$`` prompt) run in order, one page per test, in a scratch folder that links to
the repository's top-level entries (so ``tests/plugins/echo_backend.py`` resolves) and with the
example plugin package installed (as after ``pip install ./examples/llmserve-acme``). How each
command is run:

- ``llmserve serve ...`` starts that server when a later command of the page talks to a server
  (or the doc shows its log); the bare ``llmserve serve`` is the module's one embedded-model
  server. A serve line nothing talks to is checked with ``llmserve config show`` and the same
  flags (every flag and value valid). A serve line the doc shows failing (``error: ...``) runs to
  its exit. The doc's ``localhost:8000`` (or its ``--port``) is rewritten to the real port, and
  ``llmserve chat`` / ``llmserve bench serve`` without a URL get the server's.
- ``$ cat FILE`` with output shown, and a non-shell block whose first line is ``# FILE.ext``,
  write that file into the scratch folder (the doc defines it).
- Anything else runs in bash. Where the doc shows output (``console`` blocks, or a ``json`` block
  right after the shell block), it is compared: server answers (curl) by JSON shape, keys and
  value types (generated text varies); everything else as text, with ``...`` matching anything
  and runs of spaces compared as one. Where none is shown, the command must succeed (and a curl
  must not answer an error).

A block that cannot run here says so in the doc source, right above it:
``<!-- not-run: REASON -->``; test_not_run_markers_give_reasons checks each has a reason.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import EXAMPLE_PLUGIN, ROOT, free_port
from doc_runner import (DOCS, NOT_RUN, Block, Step, all_blocks, blocks, loads, log_matches, reply_error, steps,
                        text_matches, units)

BIN = Path(sys.executable).parent
ERROR_KEYS = {"error", "detail", "error_type", "acme_error"}


# ---- servers ----------------------------------------------------------------------------------

class DocServer:
    """`llmserve serve ARGS` as a doc starts it, on a free port, from the page's scratch folder."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.port = free_port()
        self.doc_port = args[args.index("--port") + 1] if "--port" in args else "8000"
        args = [a for i, a in enumerate(args) if "--port" not in (a, args[i - 1] if i else "")]
        self.proc = subprocess.Popen([str(BIN / "llmserve"), "serve", *args, "--port", str(self.port)], cwd=cwd,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines).replace(f":{self.port}", f":{self.doc_port}")

    def wait_ready(self, timeout: float = 300) -> DocServer:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.5)
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log[-3000:]}")
            try:  # /health answers while the model loads; /ready once it serves
                ready = httpx.get(f"http://127.0.0.1:{self.port}/ready", timeout=2)
                if ready.status_code == 200 or (ready.status_code == 404 and httpx.get(
                        f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready in {timeout} s:\n{self.log[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> dict[str, str]:
    """The environment of every command: this venv first on PATH, the example plugin installed,
    a fixed terminal width, no LLMSERVE_* settings from outside."""
    site = tmp_path_factory.mktemp("acme")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(EXAMPLE_PLUGIN)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "PYTEST_", "COV_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(site), COLUMNS="80", NO_COLOR="1",
               TERM="dumb", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


@pytest.fixture(scope="module")
def default_server(environment, tmp_path_factory):
    """The bare `llmserve serve` of the docs (embedded model), started on first use."""
    holder: list[DocServer] = []

    def get() -> DocServer:
        if not holder:
            holder.append(DocServer([], environment, tmp_path_factory.mktemp("default")).wait_ready())
        return holder[0]

    yield get
    for server in holder:
        server.stop()


def scratch(tmp: Path) -> Path:
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and not (tmp / entry.name).exists():
            (tmp / entry.name).symlink_to(entry)
    return tmp


def server_ports(step: Step) -> set[str]:
    """The doc ports a command talks to (a chat or load test without a URL: the default 8000)."""
    ports = set(re.findall(r"(?:localhost|127\.0\.0\.1):(\d+)", step.command))
    if not ports and ("llmserve chat" in step.command or "bench serve" in step.command):
        ports.add("8000")
    return ports


def needs_server(step: Step) -> bool:
    return bool(server_ports(step))


class Page:
    """One doc's commands, run in order."""

    def __init__(self, doc: Path, env: dict[str, str], default_server, workdir: Path) -> None:
        self.doc, self.env, self.default_server, self.workdir = doc, env, default_server, workdir
        self.server: DocServer | None = None
        self.started: list[DocServer] = []
        self.failures: list[str] = []

    # A file the doc defines: written into the scratch folder, never through a link.
    def define(self, name: str, content: str) -> None:
        target = self.workdir / name
        assert target.parent == self.workdir and not target.is_symlink(), name
        target.write_text(content if content.endswith("\n") else content + "\n")

    def current(self) -> DocServer:
        return self.server or self.default_server()

    def rewrite(self, command: str) -> str:
        server = self.current()
        command = re.sub(rf"(localhost|127\.0\.0\.1):{server.doc_port}\b", rf"\1:{server.port}", command)
        url = f"http://127.0.0.1:{server.port}"
        if "llmserve chat" in command and "--url" not in command and "--local" not in command:
            command = command.replace("llmserve chat", f"llmserve chat --url {url}/v1", 1)
        if "llmserve bench serve" in command and "--base-url" not in command and "--url" not in command:
            command = command.replace("llmserve bench serve", f"llmserve bench serve --base-url {url}", 1)
        return command

    def run(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        # No terminal: an interactive command (a chat without --quick) reads end-of-file and ends.
        # A session of its own, so that a command past its time goes with everything it started
        # (a benchmark's servers, say): left running, they would share the cores with later tests.
        proc = subprocess.Popen(["bash", "-c", command], cwd=self.workdir, env=self.env, stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def fail(self, step: Step, message: str) -> None:
        self.failures.append(f"{step.where}: $ {step.command.splitlines()[0][:100]}\n    {message}")

    def serve(self, step: Step, later: list[Step]) -> None:
        assert step.serve is not None
        if step.expected and any(line.startswith("error:") for line in step.expected.splitlines()):
            # The doc shows it failing: run it to its exit, on a free port (a server binds its
            # port before it loads anything, and 8000 may be taken here).
            if "--port" not in step.serve:
                step.command = step.command.replace("llmserve serve", f"llmserve serve --port {free_port()}", 1)
            self.command(step)
            return
        port = step.serve[step.serve.index("--port") + 1] if "--port" in step.serve else "8000"
        talked_to = False
        for nxt in later:
            if nxt.serve is not None:
                break
            if port in server_ports(nxt):
                talked_to = True
                break
        if not talked_to and not step.expected:
            self.check_flags(step)
            return
        if not step.serve and not step.env:
            self.server = None  # the module's embedded-model server
            return
        try:
            server = DocServer(step.serve, {**self.env, **step.env}, self.workdir)
            self.started.append(server)
            self.server = server.wait_ready()
        except (RuntimeError, TimeoutError) as exc:
            self.fail(step, str(exc))
            return
        if step.expected:
            deadline = time.time() + 10
            while (error := log_matches(step.expected, server.log)) and time.time() < deadline:
                time.sleep(0.2)
            if error:
                self.fail(step, f"{error}\n--- log ---\n{server.log[-2000:]}")

    def check_flags(self, step: Step) -> None:
        """A serve line nothing talks to: its flags and values through `llmserve config show`."""
        assert step.serve is not None
        args, i = [], 0
        while i < len(step.serve):
            word = step.serve[i]
            if word.startswith("-"):
                args.append(word)
                if "=" not in word and word not in booleans() and not word.startswith("--no-") and \
                        i + 1 < len(step.serve):
                    args.append(step.serve[i + 1])
                    i += 1
            else:
                args += ["--model", word]
            i += 1
        out = subprocess.run([str(BIN / "llmserve"), "config", "show", *args], cwd=self.workdir,
                             env={**self.env, **step.env}, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            self.fail(step, f"`llmserve config show` refuses these serve flags: {out.stderr.strip()[:300]}")

    def command(self, step: Step) -> None:
        words = shlex.split(step.command.replace("\\\n", " "), comments=True)
        if words[:1] == ["cat"] and len(words) == 2 and step.expected:
            self.define(words[1], step.expected)
            return
        command = self.rewrite(step.command) if needs_server(step) else step.command
        try:
            out = self.run(command)
        except subprocess.TimeoutExpired:
            self.fail(step, "timed out (120 s)")
            return
        is_curl = words[:1] == ["curl"]
        # A terminal shows both streams; curl's stderr is its progress meter, which it shows only
        # when stdout is not a terminal.
        actual = out.stdout if is_curl else out.stderr + out.stdout
        if self.server is not None:
            actual = actual.replace(f":{self.server.port}", f":{self.server.doc_port}")
        if step.expected is None:
            if out.returncode != 0:
                self.fail(step, f"exit status {out.returncode}: {actual[-500:]}")
            elif is_curl:
                first = loads(units(actual)[0]) if units(actual) else None
                if isinstance(first, dict) and ERROR_KEYS & set(first):
                    self.fail(step, f"the server answered an error: {actual[:300]}")
            return
        if is_curl:
            if (error := reply_error(step.expected, actual)) is not None:
                self.fail(step, f"{error}\n--- reply ---\n{actual[:1500]}")
        elif not text_matches(step.expected, actual):
            self.fail(step, f"output differs from the doc's\n--- doc ---\n{step.expected}\n--- actual ---\n{actual}")

    def run_all(self) -> list[str]:
        flat = [(b, s) for b in blocks(self.doc) for s in ([] if b.defines or b.not_run else steps(b))]
        all_steps = [s for _, s in flat]
        try:
            for block in blocks(self.doc):
                if block.defines:
                    self.define(block.defines, block.body)
                if block.defines or block.not_run:
                    continue
                for step in steps(block):
                    later = all_steps[next(i for i, s in enumerate(all_steps) if s.line == step.line) + 1:]
                    if step.serve is not None:
                        self.serve(step, later)
                    else:
                        self.command(step)
        finally:
            for server in self.started:
                server.stop()
        return self.failures


_BOOLEANS: set[str] = set()


def booleans() -> set[str]:
    """Flags that take no value: every boolean setting's --NAME and --no-NAME."""
    if not _BOOLEANS:
        from llmserve.config import FIELDS, _kind

        for name in FIELDS:  # by type, so a boolean whose default is null (not given) counts too
            if _kind(name) == "bool":
                flag = name.replace("_", "-")
                _BOOLEANS.update({f"--{flag}", f"--no-{flag}"})
    return _BOOLEANS


def runnable_docs() -> list[Path]:
    return [doc for doc in DOCS if any(not b.not_run and not b.defines for b in blocks(doc))]


@pytest.mark.parametrize("doc", runnable_docs(), ids=lambda d: str(d.relative_to(ROOT)))
def test_shell_examples_run_as_documented(doc, environment, default_server, tmp_path):
    failures = Page(doc, environment, default_server, scratch(tmp_path)).run_all()
    assert not failures, f"{len(failures)} example(s) of {doc.relative_to(ROOT)} fail:\n\n" + "\n\n".join(failures)


def test_not_run_markers_give_reasons():
    """Each `<!-- not-run: REASON -->` sits right above a shell block and says why in words."""
    marked = {(b.doc, b.line) for b in all_blocks() if b.not_run is not None}
    for doc in DOCS:
        text = doc.read_text()
        for match in NOT_RUN.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            reason = match.group("reason").strip()
            assert len(reason.split()) >= 3, f"{doc.relative_to(ROOT)}:{line}: a not-run marker needs a reason"
            assert any(d == doc and 0 < b - line <= 3 for d, b in marked), \
                f"{doc.relative_to(ROOT)}:{line}: a not-run marker must sit right above a shell block"


def test_the_runner_parses_and_compares_like_the_docs_mean():
    block = Block(ROOT / "README.md", 1, "console",
                  "$ curl -s localhost:8000/x -d '{\n  \"a\": 1}'\n{\"b\": 2}\n$ llmserve version\n0.1.0")
    parsed = steps(block)
    assert [s.command for s in parsed] == ["curl -s localhost:8000/x -d '{\n  \"a\": 1}'", "llmserve version"]
    assert [s.expected for s in parsed] == ['{"b": 2}', "0.1.0"]
    assert steps(Block(ROOT / "x.md", 1, "sh", "LLMSERVE_X=1 llmserve serve --port 9 &  # bg"))[0].serve == [
        "--port", "9"]
    assert text_matches("a  b\n...\nz ...", "a b\nc\nd\nz anything")
    assert not text_matches("a\nb", "a\nc")
    assert reply_error('{"text": ["x"], "n": 1}', '{"text": ["y", "z"], "n": 2.5, "extra": null}') is None
    assert reply_error('{"text": ["x"]}', '{"error": "Content-Type is not supported"}') is not None
    assert reply_error('data: {..."choices":[{"text":"x"}]}\n\ndata: [DONE]',
                       'data: {"id":"1","choices":[{"text":"y"}]}\n\ndata: [DONE]\n\n') is None
    assert reply_error('data: {..."usage":{}}', 'data: {"id":"1"}\n\n') is not None
    assert log_matches("2026-11-22 02:31:00,705 INFO x: ready in 0.8 s\nINFO:     Started server process [9515]",
                       "2026-11-27 01:51:39,693 INFO x: ready in 1.2 s\nINFO: Started server process [19936]\n") is None
