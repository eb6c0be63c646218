"""The names a plugin author imports from ``llmserve`` in one line: each is the object its owning
module defines, and importing the package stays light until a name is touched."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import llmserve

NAMES = sorted(set(llmserve.__all__) - {"__version__", "hookimpl"})


@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_its_owners_object(name):
    module = importlib.import_module(llmserve._EXPORTS[name])
    assert getattr(llmserve, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        llmserve.NoSuchThing  # noqa: B018 - the attribute access is the test


def test_import_is_light_until_a_name_is_used():
    code = ("import sys, llmserve\n"
            "heavy = ('torch', 'transformers', 'fastapi', 'pydantic')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "from llmserve import ProtocolSpec, hookimpl\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "from llmserve import WireModel\n"
            "print('fastapi' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "[]", "True False"]


ROOT = Path(__file__).resolve().parents[1]
# The built-in plugins and the example plugin: a third-party plugin can do what they do.
PLUGIN_TREES = (ROOT / "plugins", ROOT / "examples" / "llmserve-acme" / "llmserve_acme")


def core_imports(path: Path) -> list[tuple[int, str]]:
    """Every import in ``path`` (nested ones included) that reaches into a core module instead of
    the public ``llmserve`` namespace: ``(line, module)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in modules
                  if m.startswith("llmserve.") and not m.startswith("llmserve.plugins")]
    return found


def public_names(path: Path) -> set[str]:
    """The names ``path`` imports with ``from llmserve import ...``."""
    return {alias.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "llmserve"
            for alias in node.names}


def plugin_sources() -> list[Path]:
    return [p for tree in PLUGIN_TREES for p in sorted(tree.rglob("*.py")) if "build" not in p.parts]


def test_the_built_in_plugins_import_the_core_through_its_public_names_only():
    offenders = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in plugin_sources()
                 for line, module in core_imports(p)]
    assert offenders == [], "import these from llmserve (add the name to llmserve._EXPORTS if it is new)"


def test_every_name_the_plugins_import_from_llmserve_is_public():
    modules = {p.stem for p in (ROOT / "core").glob("*.py")}  # ``from llmserve import progress``
    unknown = {name for p in plugin_sources() for name in public_names(p)} - set(llmserve.__all__) - modules
    assert unknown == set()


def test_the_import_rule_sees_what_it_looks_for(tmp_path):
    source = tmp_path / "plugin.py"
    source.write_text("from llmserve import Protocol\nfrom llmserve.plugins.tool_parsers import hermes\n"
                      "import llmserve.plugins.x\n\ndef f():\n    from llmserve.server.context import ServerContext\n"
                      "    import llmserve.engine.client\n")
    assert core_imports(source) == [(6, "llmserve.server.context"), (7, "llmserve.engine.client")]
    assert public_names(source) == {"Protocol"}
