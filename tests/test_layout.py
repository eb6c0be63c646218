"""The layout rules nothing else checks: module size (Python modules, and the C sources and headers
of the plugins' native kernels), the core/plugins boundary, no import cycle inside the core or
inside the plugins, a docstring atop every module.

Imports are read from the source (``ast``), not by importing: a module's import-time edges are
its top-level imports and those under ``if TYPE_CHECKING:`` (a circle there is still a circle
for a reader and for the type checker); imports inside functions are the deliberate lazy ones
that keep ``import llmserve`` light, so they do not count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
# C sources and headers (csrc/ of native kernels): a kernel is dense, but one file per job still.
MAX_C_LINES = 800
# (folder, import name) as setup.py maps them.
TREES = ((ROOT / "core", "llmserve"), (ROOT / "plugins", "llmserve.plugins"))


def module_name(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def modules(folder: Path, package: str) -> dict[str, Path]:
    return {module_name(p, folder, package): p for p in sorted(folder.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, name: str, top_level_only: bool) -> set[str]:
    """Every module ``path`` imports (``from x import y`` counts as x.y and x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"

    def targets(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Import):
            return {alias.name for alias in node.names}
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node, name, is_package)
            return {target} | {f"{target}.{alias.name}" for alias in node.names}
        return set()

    if not top_level_only:  # every import anywhere, nested ones included
        return {t for node in ast.walk(tree) for t in targets(node)}
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:  # statements that run at import time
        for node in nodes:
            found.update(targets(node))
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, block, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return found


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Import-time edges between the given modules (package ``__init__`` edges left out: they are
    one-line docstrings, and every submodule import would otherwise be an edge to its package)."""
    return {name: {m for m in imports(path, name, top_level_only=True) if m in mods and m != name}
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def line_count(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n")


def c_sources(folder: Path) -> list[Path]:
    """Every C source and header under ``folder``."""
    return sorted(p for p in folder.rglob("*") if p.suffix in (".c", ".h") and p.is_file())


def oversized(paths: list[Path], cap: int, root: Path) -> dict[str, int]:
    """``path under root -> lines`` for each file of ``paths`` longer than ``cap`` lines."""
    return {p.relative_to(root).as_posix(): n for p in paths if (n := line_count(p)) > cap}


ALL = [(name, path) for folder, package in TREES for name, path in modules(folder, package).items()]


@pytest.mark.parametrize("name,path", ALL, ids=[name for name, _ in ALL])
def test_module_is_under_the_size_cap_and_opens_with_a_docstring(name, path):
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (cap {MAX_LINES}): split it"
    if text.strip():
        assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT)} has no module docstring"


def test_c_sources_are_under_the_size_cap():
    sources = c_sources(ROOT / "plugins")
    assert ROOT / "plugins/backends/torch/native/csrc/gguf_linear.c" in sources
    assert oversized(sources, MAX_C_LINES, ROOT) == {}, f"split these along their jobs (cap {MAX_C_LINES} lines)"


def test_core_never_imports_a_plugin():
    offenders = {}
    for name, path in modules(ROOT / "core", "llmserve").items():
        bad = sorted(m for m in imports(path, name, top_level_only=False) if m.startswith("llmserve.plugins"))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}, "core/ reaches plugins only through the registry (entry points)"


def test_no_import_cycle_inside_core():
    graph = import_graph(modules(ROOT / "core", "llmserve"))
    assert cycles(graph) == []


def test_no_import_cycle_inside_plugins():
    """Within one plugin package and between plugins: a route module that needs its dialect's
    protocol class names what it uses structurally (``tgi/generate.py``'s ``TGIHost``) rather
    than importing it back under TYPE_CHECKING."""
    graph = import_graph(modules(ROOT / "plugins", "llmserve.plugins"))
    assert cycles(graph) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """The cycle finder and the import reader catch a circle hidden behind TYPE_CHECKING, a
    relative import and a plugin import inside a function; in a plugin tree, a route module's
    back-reference to its protocol; the C size check counts lines as the module check does."""
    pkg = tmp_path / "core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Root."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""Sub."""\n')
    (pkg / "a.py").write_text('"""A."""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                              '    from llmserve.sub.b import B\n')
    (pkg / "sub" / "b.py").write_text('"""B."""\nfrom ..a import A\n\ndef f():\n    import llmserve.plugins.x\n')
    (pkg / "c.py").write_text('"""C."""\nimport llmserve.a\n')
    mods = modules(pkg, "llmserve")
    graph = import_graph(mods)
    assert cycles(graph) == [["llmserve.a", "llmserve.sub.b"]]
    assert "llmserve.plugins.x" in imports(mods["llmserve.sub.b"], "llmserve.sub.b", top_level_only=False)
    assert "llmserve.plugins.x" not in imports(mods["llmserve.sub.b"], "llmserve.sub.b", top_level_only=True)

    dialect = tmp_path / "plugins" / "protocols" / "d"
    dialect.mkdir(parents=True)
    (dialect / "__init__.py").write_text('"""D."""\nfrom .protocol import DProtocol\n')
    (dialect / "protocol.py").write_text('"""P."""\nfrom .route import Route\n')
    (dialect / "route.py").write_text('"""R."""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                                      '    from .protocol import DProtocol\n')
    plugin_graph = import_graph(modules(tmp_path / "plugins", "llmserve.plugins"))
    assert cycles(plugin_graph) == [["llmserve.plugins.protocols.d.protocol", "llmserve.plugins.protocols.d.route"]]

    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "fits.c").write_text("int x;\n" * MAX_C_LINES)
    (csrc / "long.h").write_text("/* h */\n" * (MAX_C_LINES + 1))
    (csrc / "notes.txt").write_text("x\n" * (MAX_C_LINES + 1))
    assert [p.name for p in c_sources(tmp_path)] == ["fits.c", "long.h"]
    assert oversized(c_sources(tmp_path), MAX_C_LINES, tmp_path) == {"csrc/long.h": MAX_C_LINES + 1}


def rooms(text: str) -> dict[str, str]:
    """docs/architecture.md's table rows: the room (first cell's path) -> the rest of the row."""
    found = {}
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 3:
            found[cells[1].strip().strip("`")] = "|".join(cells[2:])
    return found


def test_architecture_doc_names_every_room():
    """Every core module, dialect package and torch-backend module has its place in
    docs/architecture.md, and every path the page names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = rooms(text)
    missing = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__main__.py" or (path.name == "__init__.py" and path.parent != ROOT / "core"):
            continue
        room = rel if path.parent == ROOT / "core" else f"{path.parent.relative_to(ROOT).as_posix()}/"
        if room not in table or (room != rel and f"`{path.name}`" not in table[room]):
            missing.append(rel)
    for package in sorted(p.name for p in (ROOT / "plugins" / "protocols").iterdir() if (p / "__init__.py").exists()):
        if f"`{package}`" not in table.get("plugins/protocols/", ""):
            missing.append(f"plugins/protocols/{package}")
    torch_room = table.get("plugins/backends/torch/", "")
    for path in sorted((ROOT / "plugins" / "backends" / "torch").rglob("*.py")):
        if path.name != "__init__.py" and f"`{path.name}`" not in torch_room:
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == [], "add these to docs/architecture.md"
    named = set(re.findall(r"`((?:core|plugins)/[\w/.]*)`", text))
    assert named and sorted(p for p in named if not (ROOT / p).exists()) == []


def test_the_core_top_level_holds_few_modules():
    """The loose modules atop core/ are the kernel's shared vocabulary (requests, outputs, errors,
    config); everything with a job of its own lives in a room (a package: engine/, server/,
    cli/, guided/, ...), and client commands live in a plugin."""
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py"))
    assert len(loose) <= 12, loose


def test_the_engine_never_imports_the_server():
    """The engine reports to the server through an interface of its own (``EngineObserver`` in
    core/engine/stats.py, which the server's ``Metrics`` implements): no module of core/engine
    imports core/server, not even under ``TYPE_CHECKING`` or inside a function."""
    offenders = {}
    for name, path in modules(ROOT / "core" / "engine", "llmserve.engine").items():
        bad = sorted(m for m in imports(path, name, top_level_only=False)
                     if m == "llmserve.server" or m.startswith("llmserve.server."))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}, "the engine must not depend on the server"
