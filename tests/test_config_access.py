"""The server's settings are read typed, from their section: no ``getattr(config, "setting", default)``
in the core or the bundled plugins.

A defaulted ``getattr`` on the configuration repeats the setting's default where it is read (and
drifts from it), and the type checker sees nothing of it. The check parses every module (``ast``)
and fails on a three-argument ``getattr`` whose object is named like the server configuration
(``config``, ``self.config``, ``context.config``, ``cfg``, ...) and whose attribute is a setting or
a section, or is computed (``getattr(config, f"guided_{name}", ...)``). Defaulted reads of a Hugging
Face model config (``getattr(cfg, "num_key_value_heads", None)``) name no setting and stay allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmserve.config import FIELDS, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "plugins")
NAMES = set(FIELDS) | set(SECTIONS)
CONFIG_NAMES = {"config", "cfg", "settings", "server_config"}


def _is_config(node: ast.expr) -> bool:
    """``config``, ``cfg``, ``self.config``, ``ctx.config``, ``self.p.context.config``, ..."""
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES


def violations(source: str) -> list[tuple[int, str]]:
    """(line, the call's text) of each defaulted ``getattr`` of a setting on the configuration."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and _is_config(node.args[0])):
            continue
        name = node.args[1]
        if not isinstance(name, ast.Constant) or name.value in NAMES:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_defaulted_getattr_on_the_configuration():
    modules = [p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py")) if "build" not in p.parts]
    assert len(modules) > 100
    bad = [f"{path.relative_to(ROOT)}:{line}: {call}" for path in modules
           for line, call in violations(path.read_text(encoding="utf-8"))]
    assert bad == [], "read the setting from its section (config.scheduler.max_num_seqs):\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    'n = getattr(config, "max_num_seqs", 64)',
    'n = int(getattr(self.config, "block_size", 16))',
    'k = getattr(self.p.context.config, "return_tokens_as_token_ids", None)',
    'c = getattr(cfg, "scheduler", None)',
    'v = {n: getattr(config, f"guided_{n}", 1) for n in ("max_bytes",)}',
])
def test_checker_catches(source):
    assert len(violations(source)) == 1


@pytest.mark.parametrize("source", [
    'heads = getattr(cfg, "num_key_value_heads", None)',   # a Hugging Face model config
    'n = config.scheduler.max_num_seqs',
    'template = getattr(tokenizer, "chat_template", None)',  # a setting's name on another object
    'x = getattr(config, "max_num_seqs")',                   # no default: an AttributeError if it is gone
])
def test_checker_leaves_alone(source):
    assert violations(source) == []
