"""Lint (ruff, configured in pyproject.toml) over the whole tree and a type check (mypy) of the
kernel, run as tests so that `make test` enforces them.

mypy must see ``core/`` under its import name: setup.py maps the folder ``core`` to the package
``llmserve``, which mypy cannot follow through the editable install, so the check runs against a
temporary folder whose ``llmserve`` is a link to ``core/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MYPY_FORCE_COLOR": "0", "NO_COLOR": "1"})


def test_ruff_finds_nothing():
    out = run([str(BIN / "ruff"), "check", "--no-cache", "--output-format", "concise", "."], ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_passes_on_core(tmp_path):
    (tmp_path / "llmserve").symlink_to(ROOT / "core", target_is_directory=True)
    out = run([str(BIN / "mypy"), "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
               "--cache-dir", os.devnull, "-p", "llmserve"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout
