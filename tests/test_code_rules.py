"""Code rules: no call that turns data into code in the core or the bundled plugins.

Model output, request bodies and model files are attacker-controlled. A parser that ``eval``s a
tool argument, a cache read with ``pickle``, a checkpoint loaded with ``torch.load`` without
``weights_only=True`` or YAML read with a loader that builds Python objects runs whatever the
attacker wrote. The check parses every module (``ast``, not text search, so comments, strings
and ``model.eval()`` do not count, and ``import pickle as p; p.loads`` does) and fails on:

- ``eval``, ``exec`` (bare, or through ``builtins``);
- ``pickle`` / ``cPickle`` / ``dill`` / ``marshal`` loading (``load``, ``loads``, ``Unpickler``);
- ``torch.load`` without ``weights_only=True``;
- ``yaml.load`` / ``load_all`` without a safe loader, and ``yaml.unsafe_load``, ``full_load``,
  ``FullLoader``, ``UnsafeLoader``.

``ALLOWED`` lists each deliberate exception as (path, call) with the reason; it is empty.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "plugins")
ALLOWED: dict[tuple[str, str], str] = {}

CODE_CALLS = {"eval", "exec", "builtins.eval", "builtins.exec"}
UNPICKLERS = {f"{mod}.{fn}" for mod in ("pickle", "cPickle", "_pickle", "dill", "marshal", "joblib")
              for fn in ("load", "loads", "Unpickler")}
YAML_ALWAYS_UNSAFE = {"yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
                      "yaml.FullLoader", "yaml.UnsafeLoader", "yaml.Loader"}
SAFE_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"}


class Finder(ast.NodeVisitor):
    """Collects (line, call, why) for every forbidden call in one module."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        self.found: list[tuple[int, str, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if node.module:
                self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def qualname(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.qualname(node)
        if name in YAML_ALWAYS_UNSAFE:
            self.found.append((node.lineno, name, "a YAML loader that builds Python objects"))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        name = self.aliases.get(node.id)
        if name in YAML_ALWAYS_UNSAFE:
            self.found.append((node.lineno, name, "a YAML loader that builds Python objects"))

    def visit_Call(self, node: ast.Call) -> None:
        name = self.qualname(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if name in CODE_CALLS:
            self.found.append((node.lineno, name, "runs text as code"))
        elif name in UNPICKLERS:
            self.found.append((node.lineno, name, "unpickling runs code chosen by whoever wrote the bytes"))
        elif name == "torch.load":
            flag = keywords.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                self.found.append((node.lineno, name, "torch.load without weights_only=True unpickles"))
        elif name in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
            if loader is None or self.qualname(loader) not in SAFE_LOADERS:
                self.found.append((node.lineno, name, "yaml.load without a safe loader builds Python objects"))
        self.generic_visit(node)


def violations(source: str) -> list[tuple[int, str, str]]:
    finder = Finder()
    finder.visit(ast.parse(source))
    return finder.found


def _modules() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_code_from_data_in_core_or_bundled_plugins():
    modules = _modules()
    assert len(modules) > 50 and any(p.parts[-2:] == ("server", "guard.py") for p in modules)
    bad = []
    for path in modules:
        rel = str(path.relative_to(ROOT))
        for line, call, why in violations(path.read_text()):
            if (rel, call) not in ALLOWED:
                bad.append(f"{rel}:{line}: {call}: {why}")
    assert not bad, "\n".join(bad)


def test_every_allowed_exception_still_exists_and_says_why():
    for (rel, call), reason in ALLOWED.items():
        assert len(reason) > 20, (rel, call)
        assert any(c == call for _, c, _ in violations((ROOT / rel).read_text())), f"stale exception {rel} {call}"


# The checker itself: what it must catch, and what it must leave alone.
@pytest.mark.parametrize("source,call", [
    ("eval(text)", "eval"),
    ("exec(code, {})", "exec"),
    ("import builtins\nbuiltins.eval('1')", "builtins.eval"),
    ("import pickle\npickle.loads(b)", "pickle.loads"),
    ("import pickle as p\np.load(f)", "pickle.load"),
    ("from pickle import loads\nloads(b)", "pickle.loads"),
    ("from pickle import loads as l\nl(b)", "pickle.loads"),
    ("import marshal\nmarshal.loads(b)", "marshal.loads"),
    ("import torch\ntorch.load(path)", "torch.load"),
    ("import torch\ntorch.load(path, weights_only=False)", "torch.load"),
    ("import torch as t\nt.load(path, map_location='cpu')", "torch.load"),
    ("from torch import load\nload(path)", "torch.load"),
    ("import yaml\nyaml.load(text)", "yaml.load"),
    ("import yaml\nyaml.load(text, Loader=yaml.Loader)", "yaml.load"),
    ("import yaml\nyaml.load(text, yaml.FullLoader)", "yaml.FullLoader"),
    ("import yaml\nyaml.unsafe_load(text)", "yaml.unsafe_load"),
    ("from yaml import full_load\nfull_load(text)", "yaml.full_load"),
])
def test_checker_catches(source, call):
    assert call in [c for _, c, _ in violations(source)], violations(source)


@pytest.mark.parametrize("source", [
    "model.eval()",
    "self.eval(x)",
    "'eval(x)'",
    "# eval(x)",
    "import json\njson.loads(s)",
    "import ast\nast.literal_eval(s)",
    "import torch\ntorch.load(path, weights_only=True)",
    "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.load(text, yaml.CSafeLoader)",
    "from safetensors.torch import load_file\nload_file(path)",
    "import re\nre.compile(pattern)",
])
def test_checker_leaves_alone(source):
    assert violations(source) == []
